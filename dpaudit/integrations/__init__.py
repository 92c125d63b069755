"""Layer 7, integrations: dpaudit inside other libraries' training: Opacus (the accountant adapter,
opacus_accountant) and the Hugging Face Trainer / TRL (the audit callback, hf; DP-SGD in the Trainer with Opacus,
hf_opacus). May import every layer below: core, accounting, audit, models, canaries, probes, training,
workflows."""
