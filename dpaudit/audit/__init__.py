"""Layer 2, audit statistics: membership-inference bounds over canary scores, the sampler audit and white-box
transcript scores, torch-free. May import: core, accounting."""
