"""The DFlash drafter in MLX: the same computation as drafter/model.py, read from the same z-lab checkpoint.

    target features [c, T*H] --fc--> --hidden_norm--> context                     (once per accepted token)
    every layer:  Q = q_norm(Wq · ln(block))          K, V = k_norm(Wk ·), Wv · [context ; ln(block)]
                  RoPE at absolute positions; attention non-causal over [context ; block] (a `sliding_attention`
                  or causal layer gets its mask)
    norm(output) -> the target's LM head (target.py), times output_multiplier, soft-capped

DFlash2 adds a grouped dynamic causal convolution around each sublayer and walks the top-k candidates of every slot
(`CandidateSelector`). The context K/V of each layer are kept per request (`DraftContext`) and grow only with
accepted tokens; the block's own K/V are never stored. Weights keep z-lab's names, so `load_weights` checks every
name and shape of the checkpoint against the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafter.checkpoint import (
    MASK_EMBEDDING_NAME,
    DFlashCheckpointError,
    check_weights,
    load_drafter_config,
    load_mask_embedding,
    read_weights,
    resolve_draft_path,
)
from ..drafter.config import SLIDING_ATTENTION, DFlashConfig

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class RMSNorm(nn.Module):
    """x normalised in float32, cast back, then times the weight (drafter/model.py's order of roundings)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        normed = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight * normed.astype(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def interleaved_to_neox(x: mx.array) -> mx.array:
    """GPT-J style pairs (2i, 2i+1) as neox pairs (i, i + d/2): the channels of q and k reordered alike."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).swapaxes(-1, -2).reshape(*lead, d)


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.interleaved = config.rope_interleaved

    def _split(self, x: mx.array, n: int) -> mx.array:
        b, s, _ = x.shape
        return x.reshape(b, s, n, self.head_dim).transpose(0, 2, 1, 3)  # [b, n, s, d]

    def _rope(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        if self.interleaved:
            x = interleaved_to_neox(x)
        return x * cos + rotate_half(x) * sin

    def project_kv(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
        """K/V [b, kv_heads, s, d] of context or block rows: the same projections for both (KV injection)."""
        k = self._rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def __call__(self, x, cos, sin, context_k, context_v, mask) -> mx.array:
        b, q_len, _ = x.shape
        q = self._rope(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = mx.concatenate([context_k, k], axis=2)
        v = mx.concatenate([context_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q_len, -1))


class DynamicCausalConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the block's slots (drafter/dflash2.py has the maths)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        dyn = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], self.base_kernel[0]), dyn[..., 1, :, :]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return self._convolve(y, dyn, self.base_kernel[1])

    def _convolve(self, x: mx.array, dyn: mx.array, base: mx.array) -> mx.array:
        b, q, h = x.shape
        xs = x.reshape(b, q, self.groups, self.group_size)
        dyn = dyn.reshape(b, q, self.kernel_size, self.groups, 1)
        out = mx.zeros_like(xs)
        for o in range(self.kernel_size):
            if o >= q:
                break
            shifted = xs if o == 0 else mx.pad(xs[:, :-o], [(0, 0), (o, 0), (0, 0), (0, 0)])
            out = out + base[o].reshape(1, 1, self.groups, self.group_size).astype(x.dtype) * shifted
            out = out + dyn[:, :, o] * shifted
        return out.reshape(b, q, h)


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        if config.is_dflash2:
            h, k, g = config.hidden_size, config.conv_kernel_size, config.conv_group_size
            self.attention_conv = DynamicCausalConv(h, k, g)
            self.mlp_conv = DynamicCausalConv(h, k, g)
        self.dflash2 = config.is_dflash2

    def __call__(self, x, cos, sin, context_k, context_v, mask) -> mx.array:
        h = self.input_layernorm(x)
        if not self.dflash2:
            x = x + self.self_attn(h, cos, sin, context_k, context_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dyn = self.attention_conv.prepare(h)
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context_k, context_v, mask), dyn)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dyn)


class CandidateSelector(nn.Module):
    """DFlash2's walk through each slot's top-k draft tokens (drafter/dflash2.py): greedy, from the anchor."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = mx.zeros((config.vocab_size, config.selector_rank))
        self.successor_codebook = mx.zeros((config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, anchor: int) -> list[int]:
        """The greedy path for one row: hidden [n, H], float logits [n, V]."""
        order = mx.argsort(-logits, axis=-1)[:, : self.top_k]  # [n, k], best first (torch.topk's order)
        unary = mx.take_along_axis(logits, order, axis=-1)
        projected = self.hidden_projection(hidden)  # [n, r]
        predecessor, path = anchor, []
        for t in range(hidden.shape[0]):
            pred = self.predecessor_codebook[predecessor] * projected[t]  # [r]
            succ = self.successor_codebook[order[t]]  # [k, r]
            scores = unary[t] + (succ @ pred.astype(succ.dtype)).astype(mx.float32)
            predecessor = int(order[t, int(mx.argmax(scores))])
            path.append(predecessor)
        return path


class MlxDrafter(nn.Module):
    """z-lab compatible DFlash drafter on MLX: `layers.N.*`, `fc`, `hidden_norm`, `norm` (+ DFlash2's)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        refuse_unsupported(config)
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(config)
        inv_freq, self._attention_factor = rope_frequencies(config)
        self._inv_freq = mx.array(inv_freq)
        self.mask_row: mx.array | None = None  # `mask_embedding.pt`'s row, when the checkpoint ships one
        self.prices: Any = None  # policy.Prices, measured on this device when a request first asks for "auto"
        self.policy: Any = None  # policy.VerifyPolicy: what the requests so far taught it

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def rope(self, start: int, count: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """cos, sin [1, 1, count, d] at positions start .. start+count-1 (float32, cast as the torch drafter does)."""
        freqs = mx.arange(start, start + count, dtype=mx.float32)[:, None] * self._inv_freq[None]
        emb = mx.concatenate([freqs, freqs], axis=-1)
        cos, sin = mx.cos(emb), mx.sin(emb)
        if self._attention_factor != 1.0:
            cos, sin = cos * self._attention_factor, sin * self._attention_factor
        return cos.astype(dtype)[None, None], sin.astype(dtype)[None, None]

    @property
    def dtype(self) -> mx.Dtype:
        return self.fc.weight.dtype

    def context_kv(self, features: mx.array, start: int) -> list[tuple[mx.array, mx.array]]:
        """Every layer's K/V [1, kv_heads, c, d] of new context: target features [c, T*H] at positions start...."""
        context = self.hidden_norm(self.fc(features[None].astype(self.dtype)))
        cos, sin = self.rope(start, features.shape[0], self.dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def block_hidden(self, embeds: mx.array, anchor_position: int, context: DraftContext) -> mx.array:
        """Draft hidden states [q, H] (after the final norm) of a block's embeddings [q, H] at anchor_position..."""
        x = embeds[None].astype(self.dtype)
        q_len = x.shape[1]
        cos, sin = self.rope(anchor_position, q_len, self.dtype)
        masks = self._masks(anchor_position, q_len, context.length)
        for layer, k, v in zip(self.layers, context.keys, context.values, strict=True):
            x = layer(x, cos, sin, k, v, masks[layer.layer_type])
        return self.norm(x)[0]

    def _masks(self, anchor: int, q_len: int, c_len: int) -> dict[str, mx.array | None]:
        """Boolean [q, c+q] masks (True = attend) per layer type; None where everything is visible (a full-attention
        block over context that all precedes its anchor: decoding's case)."""
        masks: dict[str, mx.array | None] = {}
        qpos = mx.arange(anchor, anchor + q_len)[:, None]
        kpos = mx.concatenate([mx.arange(0, c_len), mx.arange(anchor, anchor + q_len)])[None]
        is_block = mx.concatenate([mx.zeros((c_len,), mx.bool_), mx.ones((q_len,), mx.bool_)])[None]
        for layer_type in set(self.config.layer_types):
            causal = self.config.layer_is_causal(layer_type)
            window = self.config.sliding_window if layer_type == SLIDING_ATTENTION else None
            if not causal and window is None:
                masks[layer_type] = None
                continue
            visible = mx.ones((q_len, c_len + q_len), mx.bool_)
            if causal:
                visible = visible & (~is_block | (kpos <= qpos))
            if window is not None:
                visible = visible & (kpos > qpos - window)
                visible = visible & (~is_block | (kpos < qpos + window))
            masks[layer_type] = visible
        return masks

    def logits(self, hidden: mx.array, head: Any) -> mx.array:
        """float32 draft logits from the target's LM head, times output_multiplier, soft-capped."""
        logits = head(hidden).astype(mx.float32)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def draft(
        self, target: Any, context: DraftContext, anchor: int, anchor_position: int, confidences: bool = False
    ) -> tuple[list[int], list[float]]:
        """Greedy drafts for the block slots after the anchor (always the whole trained block: its length is part of
        the input), and with `confidences` the confidence in each (its slot's top probability: what the policy keys
        its acceptance estimates by; else []). `target`: the MlxTarget whose embedding and LM head it shares."""
        config = self.config
        ids = mx.array([anchor] + [config.mask_token_id] * (self.block_size - 1))
        embeds = target.embed(ids)
        if (
            self.mask_row is not None
        ):  # the checkpoint's own mask row (`mask_embedding.pt`) where the mask token is
            embeds = mx.where(
                (ids == config.mask_token_id)[:, None], self.mask_row.astype(embeds.dtype), embeds
            )
        if config.input_embedding_scale != 1.0:
            embeds = embeds * config.input_embedding_scale
        hidden = self.block_hidden(embeds, anchor_position, context)[1:]
        logits = self.logits(hidden, target.head)
        confidence = mx.max(mx.softmax(logits, axis=-1), axis=-1).tolist() if confidences else []
        return self.propose(hidden, logits, anchor), confidence

    def propose(self, hidden: mx.array, logits: mx.array, anchor: int) -> list[int]:
        """Greedy drafts for the slots after the anchor: each slot's argmax (v1) or the selector's walk (DFlash2)."""
        if self.config.is_dflash2:
            return self.candidate_selector.select(hidden, logits, anchor)
        return mx.argmax(logits, axis=-1).tolist()


def refuse_unsupported(config: DFlashConfig) -> None:
    """Nothing a drafter config asks for is run approximately: the settings this backend does not implement."""
    if config.hidden_act not in ("silu", "swish"):
        raise DFlashCheckpointError(
            f"drafter hidden_act {config.hidden_act!r}: the MLX drafter implements silu"
        )


def rope_frequencies(config: DFlashConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [d/2], attention factor) of the drafter's RoPE. A scaled RoPE's are computed once, at load,
    by transformers' own functions (as the torch drafter's), then the loop runs on MLX alone."""
    d = config.head_dim
    if not config.rope_scaling:
        return 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d)), 1.0
    from ..drafter.rope import RotaryEmbedding

    rope = RotaryEmbedding(config)
    return rope.inv_freq.float().numpy(), float(rope.attention_factor)


@dataclass
class DraftContext:
    """One request's context K/V per drafter layer ([1, kv_heads, c, d]): grows with accepted tokens only."""

    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    length: int = 0

    def append(self, kvs: list[tuple[mx.array, mx.array]]) -> None:
        if not self.keys:
            self.keys = [k for k, _ in kvs]
            self.values = [v for _, v in kvs]
        else:
            self.keys = [mx.concatenate([old, k], axis=2) for old, (k, _) in zip(self.keys, kvs, strict=True)]
            self.values = [
                mx.concatenate([old, v], axis=2) for old, (_, v) in zip(self.values, kvs, strict=True)
            ]
        self.length += kvs[0][0].shape[2]


def load_drafter(path: str | Path, dtype: str | None = None) -> MlxDrafter:
    """A drafter directory (z-lab's or flashdraft's) on MLX; `dtype` None keeps the checkpoint's."""
    from mlx.utils import tree_flatten

    path = Path(resolve_draft_path(path))
    config = load_drafter_config(path)
    weights, source = read_weights(path, mx.load)
    drafter = MlxDrafter(config)
    check_weights(weights, dict(tree_flatten(drafter.parameters())), source)
    target_dtype = DTYPES[dtype] if dtype else DTYPES.get(config.dtype, next(iter(weights.values())).dtype)
    drafter.load_weights([(k, v.astype(target_dtype)) for k, v in weights.items()], strict=True)
    row = load_mask_embedding(
        path / MASK_EMBEDDING_NAME, config.hidden_size
    )  # a torch file, read once at load
    if row is not None:
        drafter.mask_row = mx.array(row.numpy()).astype(target_dtype)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter
