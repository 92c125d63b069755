"""Models: the embedded default (built offline) and loading of local Hugging Face checkpoints."""
