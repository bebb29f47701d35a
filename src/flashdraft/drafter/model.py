"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on fused target hidden states.

Data flow for one draft pass (paper §3, reference `dflash/model.py`):

    target features [c, T*H] --fc--> [c, H] --hidden_norm--> context            (once per accepted token)
    block = embed([anchor, MASK, ..., MASK])                                       (B query tokens)
    every layer i:  Q = q_norm(Wq · ln(block))
                    K = k_norm(Wk · [context ; ln(block)])   V = Wv · [context ; ln(block)]
                    RoPE at absolute positions (context j -> j, slot k -> anchor + k)
    norm(output) -> the target's LM head (not part of the drafter)

DFlash2 (z-lab, `DFlash2DraftModel`) wraps each attention and MLP sublayer in a grouped dynamic causal convolution
over the block's slots (`GroupedDynamicCausalConv`) and replaces each slot's argmax by a walk through the top-k
candidates of every slot (`CandidateSelector`); the rest, weights and cache included, is v1's.

The projected context K/V of each layer are kept in a `DraftContextCache` that grows only with accepted tokens;
the block's own K/V are never stored. One attention rule serves inference and training alike: a query in block b
sees context positions strictly before its anchor and the keys of its own block (all of them in
`full_attention` layers; causal and windowed in `sliding_attention` layers), never another block.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..files import atomic_write
from ..kernels import attention_cpp
from ..kernels.attention import kernel_serves
from .checkpoint import (
    MASK_EMBEDDING_NAME,
    check_weights,
    load_mask_embedding,
    read_weights,
    resolve_draft_path,
)
from .config import SLIDING_ATTENTION, WEIGHTS_NAME, DFlashConfig
from .context_cache import PAD_POSITION, DraftContextCache  # noqa: F401 - PAD_POSITION: this module's name for it
from .dflash2 import CandidateSelector, GroupedDynamicCausalConv
from .rope import RotaryEmbedding, apply_rope, neox_channel_order
from .vocab import load_token_counts, save_token_counts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rope_interleaved = config.rope_interleaved
        self.is_causal = False  # what a block sees is its mask's alone (read by attention.kernel_serves)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleaved:  # GPT-J style (is_neox_style: false)
            x = neox_channel_order(x)
        return apply_rope(x, cos, sin)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [b, n, s, d]

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `x` (context or block) with k_norm and RoPE: the same projections for both (KV injection). Called
        from outside `forward` for the context (a sharded drafter gathers the weights around this call)."""
        return self._project_kv(x, cos, sin)

    def _project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self._rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        block_k, block_v = self._project_kv(x, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)
        v = torch.cat([context_v, block_v], dim=2)
        if mask is not None and not isinstance(
            mask, torch.Tensor
        ):  # a FlexAttention BlockMask (training on GPU)
            out = _flex_attention(q.device)(
                q, k, v, block_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
            return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        # A CPU draft pass in bf16 (inference: the kernel has no backward): the grouped K/V heads read in place, the
        # hidden columns skipped. Against SDPA on the K/V heads repeated for each query group, one layer of
        # SmolLM2-135M's drafter, 16 queries over 512 + 16 columns of which 350 visible, 2-core Zen 4 EPYC: 190-210
        # us against 290-350.
        if not torch.is_grad_enabled() and kernel_serves(self, q, mask, q_len):
            out = attention_cpp.short_attention(q, k, v, mask, self.head_dim**-0.5)  # [b, q, heads, d]
            return self.o_proj(out.reshape(b, q_len, -1))
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


_FLEX = None
_COMPILE_MASK = True


def _flex_attention(device: torch.device):
    """flex_attention, compiled once for CUDA tensors; eager for tensors elsewhere (a slow reference path, used
    by tests), also on a machine with a GPU: the choice follows the tensors, as the block mask's does."""
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config.hidden_size, config.intermediate_size)
        self.attention_conv = self.mlp_conv = None
        if config.is_dflash2:
            h, k, g = config.hidden_size, config.conv_kernel_size, config.conv_group_size
            self.attention_conv = GroupedDynamicCausalConv(h, k, g)
            self.mlp_conv = GroupedDynamicCausalConv(h, k, g)

    def forward(self, x, cos, sin, context_k, context_v, mask, block_len: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, cos, sin, context_k, context_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dyn = self.attention_conv.prepare(h, block_len)
        x = x + self.attention_conv.finish(
            self.self_attn(h, cos, sin, context_k, context_v, mask), dyn, block_len
        )
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_len)
        return x + self.mlp_conv.finish(self.mlp(h), dyn, block_len)


def block_inputs(
    config: DFlashConfig,
    embedding_weight: torch.Tensor,
    ids: torch.Tensor,
    mask_embedding: torch.Tensor | None = None,
) -> torch.Tensor:
    """The drafter's input for block token ids, as z-lab computes it: the target's raw embedding rows times
    `input_embedding_scale` (the target's embedding module, its scaling or extra norm, is not applied). A drafter
    shipping `mask_embedding.pt` (vLLM's loader reads it) has that row in place of the mask token's."""
    rows = F.embedding(ids, embedding_weight)
    if mask_embedding is not None:
        is_mask = (ids == config.mask_token_id)[..., None]
        rows = torch.where(is_mask, mask_embedding.to(device=rows.device, dtype=rows.dtype), rows)
    return rows * config.input_embedding_scale if config.input_embedding_scale != 1.0 else rows


def draft_logits(
    config: DFlashConfig, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 draft logits from the target's LM head: times `output_multiplier`, then soft-capped by
    `final_logit_softcapping` (in that order, as z-lab's reference). `hidden` must be 2-D rows: a 3-D strided input
    would send the head through bmm with a copy of the whole weight."""
    return scale_draft_logits(config, F.linear(hidden.to(weight.dtype), weight, bias).float())


def scale_draft_logits(config: DFlashConfig, logits: torch.Tensor) -> torch.Tensor:
    """The drafter's `output_multiplier` and `final_logit_softcapping` on float32 head logits."""
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    cap = config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


class DFlashDraftModel(nn.Module):
    """z-lab compatible DFlash drafter. Weights: `layers.N.*`, `fc`, `hidden_norm`, `norm` (no embedding/head);
    DFlash2 adds `layers.N.{attention,mlp}_conv.*` and `candidate_selector.*`."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) if config.is_dflash2 else None
        self.rotary_emb = RotaryEmbedding(config)
        # The mask token's input row when the checkpoint ships one (`mask_embedding.pt`), else the target's row.
        self.mask_embedding: torch.Tensor | None = None
        self.token_counts: torch.Tensor | None = None  # [vocab] int64 (vocab.py)
        self.token_counts_source = ""
        # Multi-block (training) attention: "auto" = FlexAttention block mask on CUDA, dense boolean mask elsewhere.
        self.attention_backend = "auto"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():  # after the Linear pass: these zero some of their Linear children
            if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
                module.reset_parameters(std)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    # ------------------------------------------------------------------ forward
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[.., T*H] concatenated target layer outputs -> [.., H] context (fc + hidden_norm)."""
        return self.hidden_norm(self.fc(target_features))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        target_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: DraftContextCache | None = None,
        num_blocks: int = 1,
        block_pass: Any = None,
        context_pass: Any = None,
    ) -> torch.Tensor:
        """Draft hidden states (after the final norm) for the block queries.

        block_embeds:      [b, q, H] target embeddings of [anchor, MASK, ...] for `num_blocks` blocks of q/num_blocks
        block_positions:   [b, q] absolute positions (anchor + slot)
        target_features:   [b, c, T*H] new context features (raw concatenated taps), or None
        context_positions: [b, c] their absolute positions
        cache:             if given, the new context K/V are appended to it and all cached context is attended
        block_pass:        decoding: `self.block_pass` compiled (None: eager)
        context_pass:      decoding: `self.context_kv` compiled (None: eager)
        """
        b, q_len, _ = block_embeds.shape
        if q_len % num_blocks:
            raise ValueError(f"{q_len} query tokens do not split into {num_blocks} equal blocks")
        dtype = self.fc.weight.dtype
        new_context = target_features is not None and target_features.shape[1] > 0
        if new_context and context_positions is None:
            raise ValueError("context_positions are required with target_features")
        if cache is not None:  # decoding: the new context's K/V into the cache, then the block pass over it
            kvs = (
                (context_pass or self.context_kv)(target_features, context_positions) if new_context else None
            )
            for i, layer in enumerate(self.layers):
                if kvs is not None or len(cache.keys) <= i:
                    attn = layer.self_attn
                    kv = kvs[i] if kvs is not None else (
                        block_embeds.new_zeros(b, attn.num_kv_heads, 0, attn.head_dim, dtype=dtype),) * 2  # fmt: skip
                    cache.append(i, *kv, context_positions if i == 0 and kvs is not None else None)
            # One block over a cache of fixed tokens needs no mask (all of its context precedes the anchor) unless
            # rows are padded; anything else, a single training block over a whole sequence included, is masked.
            cached = cache.positions if cache.positions is not None else block_positions.new_zeros(b, 0)
            run = block_pass or self.block_pass
            layers_kv = (cache.keys, cache.values)
            return run(block_embeds, block_positions, cached, *layers_kv, num_blocks, not cache.needs_mask)
        x = block_embeds.to(dtype)
        cos_q, sin_q = self.rotary_emb(block_positions, dtype)
        context = None
        if new_context:
            context = self.fuse(target_features.to(dtype))
            cos_c, sin_c = self.rotary_emb(context_positions, dtype)
        masks = self._attention_masks(
            block_positions,
            block_positions.new_zeros(b, 0) if context is None else context_positions,
            num_blocks,
        )
        for layer in self.layers:
            attn = layer.self_attn
            if context is not None:
                ctx_k, ctx_v = attn.project_kv(context, cos_c, sin_c)
            else:
                ctx_k = ctx_v = x.new_zeros(b, attn.num_kv_heads, 0, attn.head_dim)
            x = layer(x, cos_q, sin_q, ctx_k, ctx_v, masks[layer.layer_type], q_len // num_blocks)
        return self.norm(x)

    def context_kv(
        self, target_features: torch.Tensor, context_positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V [b, kv_heads, c, d] of new context: the target features [b, c, T*H] fused, at their
        positions [b, c]. No cache is touched, so it can be compiled whole (the proposer passes its compiled copy)."""
        dtype = self.fc.weight.dtype
        context = self.fuse(target_features.to(dtype))
        cos, sin = self.rotary_emb(context_positions, dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def block_pass(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        num_blocks: int = 1,
        context_before_anchor: bool = False,
    ) -> torch.Tensor:
        """The layers over the block queries [b, q, H] at their positions [b, q], given every layer's cached context
        K/V and its positions [b, c]: the RoPE tables, the masks, the layers and the final norm in one function of
        fixed shapes over a static cache, so it can be compiled whole (the proposer passes its compiled copy to
        `forward`). Eager, the tables and the masks were a dozen small operators of each draft pass."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(block_positions, x.dtype)
        masks = self._attention_masks(block_positions, context_positions, num_blocks, context_before_anchor)
        block_len = block_positions.shape[1] // num_blocks
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            x = layer(x, cos, sin, k, v, masks[layer.layer_type], block_len)
        return self.norm(x)

    def propose_tokens(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts and the drafter's confidence in each, for the slots after the anchor: [b, n] and [b, n]
        from hidden states [b, n, H] and draft logits [b, n, V]. v1: each slot's argmax and its probability;
        DFlash2: the candidate selector's path from `anchors` [b]."""
        if self.candidate_selector is not None:
            return self.candidate_selector.select(hidden, logits, anchors)
        probs, tokens = logits.softmax(-1).max(-1)
        return tokens, probs

    def sample_tokens(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor: torch.Tensor,
        params: Any,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts for one row and the distributions they were drawn from: [n] and [n, V] from hidden [1, n, H]
        and logits [1, n, V]. v1: each slot from its processed draft distribution (the request's temperature, top-k,
        top-p); DFlash2: the selector's walk, each step drawn from softmax(scores / T) over its candidates (as
        z-lab's sampler). `uniforms` [n]: one per slot."""
        from ..sampling import inverse_cdf_sample, target_probs

        if self.candidate_selector is None:
            q = target_probs(logits[0], params)
            return inverse_cdf_sample(q, uniforms), q
        return self.candidate_selector.sample(hidden, logits, anchor, params.temperature, uniforms)

    def _attention_masks(
        self,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        num_blocks: int,
        context_before_anchor: bool = False,
    ) -> dict[str, Any]:
        """Boolean [b, 1, q, c+q] masks (True = attend) per layer type, FlexAttention BlockMasks when that backend is
        on, or None where everything is visible.

        A query of block j sees context positions < anchor_j and its own block; a causal layer (`sliding_attention`
        unless `is_causal` says otherwise, every layer when it is true) sees only block keys up to itself, and
        `sliding_attention` layers only keys within `sliding_window` positions.
        """
        b, q_len = block_positions.shape
        blk = q_len // num_blocks
        need_causal = any(map(self.config.layer_is_causal, self.config.layer_types))
        need_window = SLIDING_ATTENTION in self.config.layer_types
        masks: dict[str, torch.Tensor | None] = {}
        if num_blocks == 1 and not need_causal and not need_window and context_before_anchor:
            # Inference fast path: one block, and all cached context lies before its anchor by construction.
            return {"full_attention": None, SLIDING_ATTENTION: None}
        device = block_positions.device
        q_block = torch.arange(q_len, device=device) // blk  # [q]
        anchors = block_positions.view(b, num_blocks, blk)[:, :, 0]  # [b, nb]
        q_anchor = anchors[:, q_block]  # [b, q]
        use_flex = self.attention_backend == "flex" or (
            self.attention_backend == "auto" and device.type == "cuda" and num_blocks > 1
        )
        if use_flex and context_positions.shape[1] > 0:
            return {
                t: self._flex_block_mask(t, block_positions, context_positions, q_block, q_anchor)
                for t in set(self.config.layer_types)
            }
        ctx_visible = context_positions[:, None, :] < q_anchor[:, :, None]  # [b, q, c]
        own_block = (q_block[:, None] == q_block[None, :]).expand(b, q_len, q_len)  # [b, q, q]
        causal = block_positions[:, None, :] <= block_positions[:, :, None]  # key pos <= query pos
        for layer_type in set(self.config.layer_types):
            is_sliding = layer_type == SLIDING_ATTENTION
            ctx, blk_vis = ctx_visible, own_block
            if self.config.layer_is_causal(layer_type):
                blk_vis = blk_vis & causal
            if is_sliding:  # keys within the window of the query, on both sides (only behind when causal)
                w = self.config.sliding_window
                ctx = ctx & (context_positions[:, None, :] > block_positions[:, :, None] - w)
                blk_vis = blk_vis & (block_positions[:, None, :] > block_positions[:, :, None] - w)
                blk_vis = blk_vis & (block_positions[:, None, :] < block_positions[:, :, None] + w)
            masks[layer_type] = torch.cat([ctx, blk_vis], dim=-1)[:, None]
        return masks

    def _flex_block_mask(self, layer_type, block_positions, context_positions, q_block, q_anchor):
        """The same rule as the dense mask, as a FlexAttention BlockMask: the [q, c+q] matrix is never built,
        and tiles that are fully masked (other blocks) are skipped — what makes 512 anchors per sequence cheap."""
        from torch.nn.attention.flex_attention import create_block_mask

        b, q_len = block_positions.shape
        c_len = context_positions.shape[1]
        causal = self.config.layer_is_causal(layer_type)
        window = self.config.sliding_window if layer_type == SLIDING_ATTENTION else None

        def mask_mod(bi, _h, qi, ki):
            is_ctx = ki < c_len
            ctx_pos = context_positions[bi, ki.clamp(max=c_len - 1)]
            kb = (ki - c_len).clamp(min=0)
            key_pos = torch.where(is_ctx, ctx_pos, block_positions[bi, kb])
            q_pos = block_positions[bi, qi]
            visible = torch.where(is_ctx, ctx_pos < q_anchor[bi, qi], q_block[qi] == q_block[kb])
            if causal:
                visible = visible & (is_ctx | (key_pos <= q_pos))
            if window is not None:
                visible = visible & (key_pos > q_pos - window) & (key_pos < q_pos + window)
            return visible

        shape = dict(B=b, H=None, Q_LEN=q_len, KV_LEN=c_len + q_len, device=block_positions.device)
        global _COMPILE_MASK  # compiled on CUDA (the mask of 512 blocks in one kernel), eager if that ever fails
        if _COMPILE_MASK and block_positions.device.type == "cuda":
            try:
                return create_block_mask(mask_mod, **shape, _compile=True)
            except Exception as e:  # any compiler failure: the eager mask is the same mask
                _COMPILE_MASK = False
                warnings.warn(f"compiled block mask failed ({type(e).__name__}), eager now", stacklevel=2)
        return create_block_mask(mask_mod, **shape)

    # ------------------------------------------------------------------ construction and checkpoints
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        vocab_size: int | None = None,
        seed: int | None = None,
        input_embedding_scale: float | None = None,
        arch: str = "dflash",
    ) -> DFlashDraftModel:
        """A fresh (untrained) drafter sized for `target_config` (a transformers config)."""
        config = DFlashConfig.for_target(
            target_config,
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            input_embedding_scale=input_embedding_scale,
            arch=arch,
        )
        if seed is not None:
            torch.manual_seed(seed)
        return cls(config)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write `config.json` + `model.safetensors` in z-lab's layout (atomically: temp file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.fc.weight.dtype
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        self.config.dtype = next(name for name, dt in _DTYPES.items() if dt == dtype)
        atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
        if self.mask_embedding is not None:
            row = self.mask_embedding.detach().to(dtype).cpu().clone()
            atomic_write(path / MASK_EMBEDDING_NAME, lambda tmp: torch.save(row, tmp))
        if self.token_counts is not None:
            save_token_counts(path, self.token_counts, self.token_counts_source)
        self.config.save_pretrained(path)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> DFlashDraftModel:
        """Load a drafter directory (z-lab's or ours). `dtype=None` keeps the checkpoint's dtype."""
        from safetensors.torch import load_file

        path = Path(resolve_draft_path(path))
        config = DFlashConfig.from_pretrained(path)
        mask_embedding = load_mask_embedding(path / MASK_EMBEDDING_NAME, config.hidden_size)
        state, source = read_weights(path, load_file)
        with torch.device("meta"):
            model = cls(config)
        check_weights(state, model.state_dict(), source)
        load_dtype = dtype or _DTYPES.get(config.dtype, next(iter(state.values())).dtype)
        model = model.to_empty(device=device or "cpu")
        model.load_state_dict({k: v.to(load_dtype) for k, v in state.items()}, strict=True)
        model.rotary_emb = RotaryEmbedding(config).to(device or "cpu")
        model.mask_embedding = mask_embedding
        # what its draft vocabulary is drawn from (vocab.py), and what was counted
        model.token_counts, model.token_counts_source = load_token_counts(path) or (None, "")
        return model.to(load_dtype).eval()

    def as_dflash2(self, **settings: int) -> DFlashDraftModel:
        """A DFlash2 drafter holding this v1 drafter's weights, its convolutions and selector freshly initialised
        (identity convolutions, a selector that picks each slot's argmax): it proposes what this drafter proposes
        until trained further. `settings` override DFlash2's defaults (conv_kernel_size, selector_top_k, ...)."""
        from dataclasses import replace

        from .config import _dflash2_defaults

        if self.config.is_dflash2:
            return self
        config = replace(
            self.config, **{**_dflash2_defaults(self.config.hidden_size, self.config.vocab_size), **settings}
        )
        config.validate()
        fresh = DFlashDraftModel(config).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        missing, unexpected = fresh.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
        fresh.mask_embedding = self.mask_embedding
        return fresh

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
