"""Layer 5, training: the bundled trainers, DP-ZO (zeroth order, one noisy scalar per step) and DP-SGD (Opacus),
plus their non-private baselines, with a privacy ledger written every step; their white-box runs attach the probe
(probes/). A method is one
record (methods.py) plus its trainer's file; the DP-SGD step is a chain of overridable seams (dp_step.py) where the
probe and planted bugs attach. May import: core, accounting, audit, models, canaries, probes."""
