"""The drafter's rotary position embedding: neox-style RoPE (the Qwen3 / Llama convention) at arbitrary absolute
positions, with transformers' own scaled frequencies where the drafter's config asks for them."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .config import DFlashConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qwen3_rope_config(
    hidden_size: int, heads: int, head_dim: int, max_positions: int, theta: float, scaling: dict
):
    """A transformers Qwen3Config carrying this RoPE, in the installed transformers' convention: 5.x reads
    `rope_parameters` (theta inside), 4.x `rope_scaling` and `rope_theta` apart."""
    from transformers import Qwen3Config

    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        rope = {"rope_parameters": {**scaling, "rope_theta": theta}}
    else:
        rope = {"rope_scaling": dict(scaling), "rope_theta": theta}
    return Qwen3Config(
        hidden_size=hidden_size,
        num_attention_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        **rope,
    )


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (the Qwen3/Llama convention) evaluated at arbitrary absolute positions. A non-default
    `rope_scaling` (linear, yarn, llama3) gets its frequencies and attention factor from transformers' own RoPE
    functions, as z-lab's drafter (a transformers Qwen3 rotary embedding) does."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        head_dim, self.attention_factor = config.head_dim, 1.0
        if config.rope_scaling:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = qwen3_rope_config(
                config.hidden_size,
                config.num_attention_heads,
                head_dim,
                config.max_position_embeddings,
                config.rope_theta,
                config.rope_scaling,
            )
            with torch.device(
                "cpu"
            ):  # real numbers even while a checkpoint is being built on the meta device
                rope_type = config.rope_scaling["rope_type"]
                inv_freq, self.attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
            inv_freq = inv_freq.float()
        else:
            inv_freq = 1.0 / (
                config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # broadcast over heads


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def neox_channel_order(x: torch.Tensor) -> torch.Tensor:
    """Channels (x0, x1, x2, x3, ...) reordered as (x0, x2, ..., x1, x3, ...): GPT-J style RoPE's pairs (2i, 2i + 1)
    become the neox style's (i, i + d/2). Attention reads q and k only through q . k, so reordering the channels of
    both alike changes nothing else."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


__all__ = ["RotaryEmbedding", "apply_rope", "neox_channel_order", "qwen3_rope_config", "rotate_half"]
