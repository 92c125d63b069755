"""Layer 6, workflows: what trains and scores in one go: `audit run` (audit_run), scoring checkpoints on canaries
(scoring) and rebuilding a DP-ZO model from its log (replay). May import: core, accounting, audit, models,
canaries, training."""
