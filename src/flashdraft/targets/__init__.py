"""Targets: any Hugging Face decoder-only model seen through what DFlash needs from it, the exact rollback of
recurrent state, image-text prompts, and where a model keeps its parts."""
