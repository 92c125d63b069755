"""Layer 4, training: the bundled trainers, DP-ZO (zeroth order, one noisy scalar per step) and DP-SGD (Opacus),
plus their non-private baselines, with a privacy ledger written every step, and the white-box probe. May import:
core, accounting, audit, models, canaries."""
