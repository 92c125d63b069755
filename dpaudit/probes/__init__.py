"""Layer 4, probes: what watches a DP run from inside it and checks what it releases, whoever's loop it is. The
white-box probe (probe.py: canaries on every trainable tensor, the transcript, the looks of a watched run, the noise
and clipping tallies), its Opacus adapter (probe_opacus.py), the pipeline probe (pipeline_probe.py: canaries in the
user's data) and the update's health check (health.py). The bundled trainers (training/) attach the same probe for
their white-box runs. May import: core, accounting, audit, models, canaries."""
