"""Layer 6, integrations: dpaudit inside other libraries' training: Opacus (the accountant adapter,
opacus_accountant). May import every layer below: core, accounting, audit, models, canaries, training,
workflows."""
