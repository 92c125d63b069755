"""Layer 3, models: the embedded default (built offline) and loading of local Hugging Face and GGUF checkpoints.
May import: core, accounting, audit."""
