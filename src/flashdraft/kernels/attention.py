"""The attention a target runs on a CPU for short queries (decode steps and verifies): bf16, fp32, and compiled.

PyTorch's fused CPU attention (`scaled_dot_product_attention`) is slow in bf16 at a handful of queries: on a 2-core
EPYC, SmolLM2-135M after 256 tokens, 90-140 µs per layer for one query and 275 µs for a verify of sixteen; the two
plain products this module runs instead take 60-90 µs and about 110 µs. `short_query_attention` is transformers'
eager attention (scores as a bf16 product, softmax in fp32, the probabilities back to bf16 for the product with the
values) without copying the keys and values of grouped-query heads: the query heads that share a KV head are stacked
into one matrix, so each KV head is one product. It is registered with transformers' `AttentionInterface` as
"short_query" (masks built as for "sdpa") and serves queries of up to `SHORT_QUERY` tokens; longer ones (prefill) go
to transformers' SDPA function unchanged.

In bf16, once attention_cpp.py's kernel is built (`use`, before anything is traced), short queries with a mask it
reads (bool or added, or none where causal) go to that kernel instead: one pass per query row in fixed summation
orders, hidden columns skipped: 18 us a layer with the call (34 under the profiler) where the two products and
their softmax took 86 (SmolLM2-135M, one query over 256-320 columns, 2-core Zen 4 EPYC); its bits depend on
neither the mask's width (so bf16's static mask covers only the columns in use, `narrow_mask`) nor where a row's
columns sit among hidden ones (draft trees). The rest of this docstring is the path without it (other dtypes, or
no C++ compiler).

Its result for a query row does not depend on the rows beside it: the products go to oneDNN's bf16 kernel, which on
the CPUs measured here reduces each output element in the same order whatever the number of rows, and the masked
columns add exact zeros. With int8 weights, whose kernel is row-invariant too (quantize.py), a verify of n tokens
then gives every token the bits a one-token step gives, and DFlash equals plain decoding bit for bit
(tests/test_attention.py; on an avx2 CPU, where bf16 is emulated, 1 in 4-6 int8 outputs still parted:
benchmarks/README.md). In bf16 the MLP's down projection is not (oneDNN splits a reduction over 1,536 inputs
differently for one row and for several), so bf16 outputs can still part from plain decoding on near-ties.
Options it cannot honour (logit soft-capping, attention sinks, position biases) send the call to SDPA as well.

Eager fp32 short queries with a mask go to SDPA's own kernel with `enable_gqa`: transformers' SDPA function copies the
grouped K/V heads (`repeat_kv`) whenever a mask is given on a CPU, and past one query it cannot fold the groups into
the query either. On the avx2 EPYC below, 16 rows verifying 2 tokens after 153 columns: 1.05 ms per layer with the
copies, 0.59 without (identical outputs), and a whole 16 x 2 verify of SmolLM2-135M spent 25 of its 139 ms copying.

Compiled on a CPU (`--compile`, compiled.py) an fp32 target takes it too: inductor fuses the scaling, the mask and the
softmax around the two products, where transformers' SDPA path under dynamo first copies the grouped K/V heads
(`repeat_kv`). SmolLM2-135M fp32 after 256 tokens, one thread on a 2-core AMD EPYC (avx2), interleaved in one
process: a plain step 29.5 -> 26.1 ms, DFlash steps verifying 4 / 16 tokens 62.4 -> 57.4 / 159 -> 150 ms. Eager fp32
its products are no faster than SDPA (68 against 67 ms), so eager fp32 keeps SDPA's kernel (above).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import attention_cpp

# Not "flashdraft": transformers takes every implementation whose name contains "flash" for flash attention
# (`is_flash_attention_requested`), and refuses to build a model from such a config without a flash kernel.
NAME = "short_query"
SHORT_QUERY = 64  # queries up to this many tokens per row take the short-query path
KERNEL_DTYPES = (torch.bfloat16,)  # dtypes whose short queries run attention_cpp's kernel (where it builds)
# a config attribute: this model's short queries run the kernel in its dtype too (`use`: the plan asks it for a w8a16
# target in fp32, whose rows hold only around the kernel)
KERNEL_FLAG = "flashdraft_attention_kernel"
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def short_query_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [b, h, n, d], key/value [b, kv_heads, L, d], mask (bool: True attends; float: added) broadcastable to
    [b, h, n, L] or None (causal, the queries the last n positions) -> ([b, n, h, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, n, d = query.shape
    if attention_mask is not None and attention_mask.dim() == 4:
        # The engine's static cache (`narrow_mask`): its mask may cover only the columns in use. Compiled, always cut
        # (no guard on which width is the smaller: one graph for both).
        width = torch.sym_min(attention_mask.shape[-1], key.shape[2])
        if torch.compiler.is_compiling() or width < key.shape[2]:
            key, value = key[:, :, :width], value[:, :, :width]
    kv_heads, length = key.shape[1], key.shape[2]
    if n > SHORT_QUERY or dropout or any(kwargs.get(k) is not None for k in _UNSUPPORTED) or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    eager_fp32 = query.dtype == torch.float32 and not torch.compiler.is_compiling() and not _flagged(module)
    if eager_fp32 and d == value.shape[-1] <= 256 and (attention_mask is not None or n == 1):
        # SDPA's own kernel, every query head reading its KV head in place (one query and no mask: it sees all)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=heads != kv_heads
        )
        return out.transpose(1, 2).contiguous(), None
    groups = heads // kv_heads
    scale = d**-0.5 if scaling is None else scaling
    if kernel_serves(module, query, attention_mask, n):
        mask = None if attention_mask is None else _last_contiguous(attention_mask[..., :length])
        out = attention_cpp.short_attention(
            query, _last_contiguous(key), _last_contiguous(value), mask, scale
        )
        return out, None
    # [b, kv, g*n, d]: head h uses KV head h // groups (transformers' repeat_kv)
    scores = torch.matmul(query.reshape(b, kv_heads, groups * n, d), key.transpose(-1, -2))
    scores = scores.view(b, kv_heads, groups, n, length) * scale
    if attention_mask is None:
        if n > 1 and getattr(module, "is_causal", True):  # query i is position L - n + i
            keys = torch.arange(length, device=query.device)
            sees = keys <= torch.arange(length - n, length, device=query.device)[:, None]
            scores = scores.masked_fill(~sees, float("-inf"))
    else:
        mask = attention_mask[..., :length]
        if mask.shape[1] == heads and heads > 1:
            mask = mask.view(mask.shape[0], kv_heads, groups, mask.shape[2], length)
        else:
            mask = mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, kv_heads, groups * n, length), value)
    return out.view(b, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None  # MLA: v heads narrower


def kernel_serves(module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None, n: int) -> bool:
    """Whether attention_cpp's kernel (built for this dtype) takes the call: a mask it reads (bool or added in the
    query's dtype, 4-D), or none with causal queries (or one query)."""
    if query.device.type != "cpu" or not attention_cpp.ready(query.dtype):
        return False
    if query.dtype not in KERNEL_DTYPES and not _flagged(module):
        return False
    if mask is None:
        return n == 1 or getattr(module, "is_causal", True)
    return mask.dim() == 4 and mask.dtype in (torch.bool, query.dtype)


def _flagged(module: torch.nn.Module) -> bool:
    """Whether `use` gave this model's short queries the kernel in any dtype it has one for (`KERNEL_FLAG`)."""
    return bool(getattr(getattr(module, "config", None), KERNEL_FLAG, False))


def kernel_ready(dtype: torch.dtype) -> bool:
    """Whether short queries in `dtype` run attention_cpp's kernel: a dtype of KERNEL_DTYPES, its kernel built."""
    return dtype in KERNEL_DTYPES and attention_cpp.ready(dtype)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def narrow_mask(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine gives `model` a static-cache mask narrower than the cache (the columns in use, rounded up
    to `kv_cache.MASK_STEP`), which this module's attention reads alone: its two products and the softmax scale
    with the columns they read (one query of SmolLM2-135M, its three KV heads: the first product took 18 / 33 / 61
    µs a layer at 256 / 512 / 1,024 columns, one thread, 2-core AMD EPYC), and a static capacity runs up to twice
    the columns in use.
    On a CPU in fp32, whose products' summation order follows the width (a token's bits can change with it; fp32's
    verify is not batch-invariant anyway: benchmarks/README.md), and in a dtype attention_cpp's kernel serves, whose
    bits do not depend on the width; not in the other dtypes, which keep one width per capacity for the bits they
    claim, and not on a GPU, where a fixed width is what a CUDA graph replays."""
    attention = getattr(model.config, "_attn_implementation", None)
    return attention == NAME and device.type == "cpu" and (dtype == torch.float32 or kernel_ready(dtype))


def register() -> None:
    """Make `NAME` an attention implementation transformers knows (idempotent)."""
    from transformers import AttentionInterface

    if NAME in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(NAME, short_query_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53 builds masks by implementation name elsewhere
        return
    AttentionMaskInterface.register(NAME, sdpa_mask)


def runs_sdpa(model: torch.nn.Module) -> bool:
    """Whether `model` runs transformers' SDPA function (or this module's attention already): what `use` switches."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", NAME)


def use(model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    """Switch `model` (its sub-configs too) to the short-query attention; given a `dtype`, build attention_cpp's
    kernel for it now (before anything is traced), and outside KERNEL_DTYPES mark the model's configs so that its
    short queries in that dtype take the kernel too (`KERNEL_FLAG`)."""
    register()
    flag = dtype is not None and attention_cpp.prepare(dtype) and dtype not in KERNEL_DTYPES
    for config in _configs(model.config):
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = NAME
        if flag:
            setattr(config, KERNEL_FLAG, True)


def _configs(config: Any) -> list[Any]:
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found.extend(_configs(sub))
    return found
