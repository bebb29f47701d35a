"""The MLX backend (Apple silicon; `mlx[cpu]` on Linux): DFlash decoding with no torch in the loop.

    target.py    an mlx-lm model as the target: its config normalised from the Hugging Face one (or refused by
                 name), the tapped layers' outputs captured, its embedding and LM head for the drafter
    drafter.py   the DFlash drafter (v1 and DFlash2) in MLX, read from the same z-lab-format checkpoint
    sampling.py  the sampling law on host arrays: the same uniforms per position as the torch engine
    decoder.py   the decode loop (plain decoding is the same loop with no drafts), KV trim on rejection

Trees, batches, structured output and training stay on the torch backend (docs/mac.md says what runs where).
"""

from __future__ import annotations

from .decoder import MlxDecoder, MlxPipeline, decode, generate, generate_ar, load_pipeline

__all__ = ["MlxDecoder", "MlxPipeline", "decode", "generate", "generate_ar", "load_pipeline"]
