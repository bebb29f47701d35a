"""One C++ operator for a whole decoder layer of a `--quantize w8a16` target at decode: a Llama-style pre-norm layer
(RMSNorm, q / k / v, RoPE, the static cache's write, attention, o, RMSNorm, SiLU-gated MLP, the two residuals) in
one call, in bf16 or fp32, from a compiled graph or eagerly. Compiled, inductor's graph of the layer made eight calls:
four w8a16 products, the attention and three kernels of its own (the norms, RoPE with the cache's write, SiLU x
up), each with its Python call, its checks and its views. On a 2-core Emerald Rapids Xeon half of a one-token step
of SmolLM2-135M was the first thread's Python and torch's dispatch while the second waited (`perf`,
benchmarks/README.md, stop 75); 37 % of it lay outside the operators (stop 76). Eager, the model's own layer made
about twenty: fused, an eager w8a16 target decodes within about a quarter of a compiled one's speed, with no compile
(on an avx2 CPU, where w8a16 runs fp32 rows, `--compile` is a start of minutes; benchmarks/README.md, stop 92).

The operator calls the w8a16 product (w8a16_cpp.py) and the short-query attention (attention_cpp.py) through
torch's dispatcher, and does the rest in plain loops, each query row alone:

    x   = rms(hidden) * w_in                      fp32, rounded once (bf16; fp32 is stored as computed)
    q, k, v = x @ W_qkv   (q_norm / k_norm per head where the layer has them)
    q, k = RoPE(q, k; cos, sin)                   fp32, rounded once
    cache[columns] = k, v;   a = attention(q, cache, mask)
    h   = hidden + a @ W_o;   y = rms(h) * w_post
    out = h + (silu(y @ W_gate) * (y @ W_up)) @ W_down       silu x up in fp32, rounded once

Each step's result for a row depends on that row alone (the products are exact integer sums, the attention's bits
do not depend on the rows beside it), so a verify of n tokens gives each token the bits of a one-token step and
DFlash stays plain decoding bit for bit. Each tensor the layer stores is rounded once, from fp32, but its sums run
in other orders than those of the unfused layer, so the two give other bits (SmolLM2-135M: the drafter's features
about 4 % from the fp32 model's either way, benchmarks/README.md): the layer is used alike by every decode step of a
target (`fuse`, where the kernel plan says: a w8a16 target with the attention kernel, eager or compiled), never for
some steps and not others.

`fuse` joins a layer's q / k / v weights (and gate / up) into one packed weight; the layers' own buffers become
views of it, so the join costs no memory. Layers it cannot run as the model defines them keep their own forward
(`refusal`: another layer class or activation, linears other than w8a16, widths that fill no whole tile), and so
does every call it does not serve: a prompt's prefill (the growing cache), a longer query than the attention
kernel's, a partial rotary, a mask it cannot read.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from . import attention, attention_cpp, cpp_build, w8a16_cpp

# transformers' layer classes whose forward is the pre-norm layer above (their attention: q / k / v / o, optionally
# q_norm / k_norm over each head; their MLP: gate / up / down)
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")

# The layer's element-wise parts (norms, RoPE and the cache's write, SiLU, the residuals) are split between the
# threads from this many rows (a verify's tokens, a batch's rows); fewer run on the calling thread.
PARALLEL_ROWS = 4

_library = torch.library.Library("flashdraft", "FRAGMENT")
_library.define(
    "decoder_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor columns, Tensor mask, Tensor norm_in, Tensor norm_post, Tensor? q_norm, Tensor? k_norm, "
    "Tensor qkv_packed, Tensor qkv_scales, Tensor qkv_colsums, Tensor? qkv_bias, "
    "Tensor o_packed, Tensor o_scales, Tensor o_colsums, Tensor? o_bias, "
    "Tensor gu_packed, Tensor gu_scales, Tensor gu_colsums, Tensor? gu_bias, "
    "Tensor down_packed, Tensor down_scales, Tensor down_colsums, Tensor? down_bias, "
    "int heads, int kv_heads, int head_dim, int intermediate, float eps, float scale) -> Tensor"
)
_built: bool | None = None  # None: not tried yet
_loaded: Any = None  # the loaded library (kept, so it stays loaded)


def _fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden)


torch.library.register_fake("flashdraft::decoder_layer", _fake, lib=_library)


def source() -> str:
    """The library's C++ source (csrc/decoder_layer.cpp with its constants)."""
    return cpp_build.source_file("decoder_layer.cpp").replace("@PARALLEL_ROWS@", str(PARALLEL_ROWS))


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the layer's element types
DTYPES = tuple(DTYPE_NAMES)


def prepare(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Build (or load from inductor's cache) the library, once the two kernels it calls are built for `dtype`;
    whether the operator serves in `dtype`. Outside any graph being traced."""
    global _built, _loaded
    if dtype not in DTYPES or not (w8a16_cpp.prepare() and attention_cpp.prepare(dtype)):
        return False
    if _built is None:
        _built = False
        _loaded = cpp_build.load(source(), "the fused decoder layer")
        _built = _loaded is not None
    return bool(_built)


def _join(layer: nn.Module, part: str, linears: list[nn.Module]) -> None:
    """Linears of one input as one packed weight, held as `layer`'s buffers `fused_{part}_*` (packed, scales,
    colsums, bias: None where none has one); the linears' own buffers become views of it."""
    packed = torch.cat([m.packed for m in linears])
    scales = torch.cat([m.scales for m in linears])
    colsums = torch.cat([m.colsums for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.scales.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])
    tiles = cols = 0
    for m in linears:
        t = m.packed.shape[0]
        m.packed = packed[tiles : tiles + t]
        m.colsums = colsums[tiles * w8a16_cpp.TILE_COLUMNS : (tiles + t) * w8a16_cpp.TILE_COLUMNS]
        m.scales = scales[cols : cols + m.out_features]
        if m.bias is not None:
            m.bias = bias[cols : cols + m.out_features]
        tiles, cols = tiles + t, cols + m.out_features
    for field, t in (("packed", packed), ("scales", scales), ("colsums", colsums), ("bias", bias)):
        layer.register_buffer(f"fused_{part}_{field}", t, persistent=False)


def refusal(layer: nn.Module, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why `layer` cannot run as the fused operator in `dtype` (None: it can)."""
    from .quantize import W8A16Linear

    if type(layer).__name__ not in LAYER_CLASSES:
        return f"a {type(layer).__name__}"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or mlp is None or not all(isinstance(getattr(attn, n, None), W8A16Linear) for n in names):
        return "linears other than w8a16"
    if not all(isinstance(getattr(mlp, n, None), W8A16Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return "linears other than w8a16"
    act = type(getattr(mlp, "act_fn", None)).__name__
    if act not in ("SiLU", "SiLUActivation"):  # torch's, transformers' (ACT2FN["silu"])
        return f"the activation {act}"
    head_norms = [getattr(attn, n) for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, *head_norms):
        if getattr(norm, "weight", None) is None or norm.weight.dtype != dtype:
            return f"norms without {DTYPE_NAMES.get(dtype, dtype)} weights"
    d, heads, kv_heads = attn.head_dim, attn.config.num_attention_heads, attn.config.num_key_value_heads
    shapes = {
        "q_proj": heads * d,
        "k_proj": kv_heads * d,
        "v_proj": kv_heads * d,
    }
    for n, width in shapes.items():
        if getattr(attn, n).out_features != width:
            return f"{n}'s width {getattr(attn, n).out_features} is not {width}"
    joined = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    if any(m.out_features % w8a16_cpp.TILE_COLUMNS for m in joined):
        return "widths that fill no whole tile"
    if d % 2:
        return "an odd head dimension"
    return None


def fuse(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Give each decoder layer of `model` (in `dtype`: bf16 or fp32) that the operator runs exactly a forward through
    it at decode (the static cache, a short query, the mask a 4-D tensor); the number of layers fused. Idempotent."""
    if not prepare(dtype):
        return 0
    fused = 0
    for layer in model.modules():
        if hasattr(layer, "_unfused_forward"):
            fused += 1
            continue
        if refusal(layer, dtype) is not None:
            continue
        attn, mlp = layer.self_attn, layer.mlp
        _join(layer, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        _join(layer, "o", [attn.o_proj])
        _join(layer, "gu", [mlp.gate_proj, mlp.up_proj])
        _join(layer, "down", [mlp.down_proj])
        layer._unfused_forward = layer.forward
        layer.forward = types.MethodType(_forward, layer)
        fused += 1
    return fused


def _static_layer(cache: Any, layer_idx: int) -> Any:
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if getattr(layer, "static", None) is not None else None


def _forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    named = {"cache": cache} if cache is not None else {}
    for name in ("past_key_values", "past_key_value"):  # transformers < 5.x names it so
        if not named and kwargs.get(name) is not None:
            named = {name: kwargs.pop(name)}
    cache = next(iter(named.values()), None)
    attn, mlp = self.self_attn, self.mlp
    kv = _static_layer(cache, attn.layer_idx)
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    runs = (
        kv is not None
        and hidden_states.dim() == 3
        and hidden_states.dtype in DTYPES
        and hidden_states.dtype == self.input_layernorm.weight.dtype
        and hidden_states.shape[1] <= attention.SHORT_QUERY
        and attention_mask is not None  # the static cache's mask, which the attention kernel reads
        and attention.kernel_serves(attn, hidden_states, attention_mask, hidden_states.shape[1])
        and cos is not None
        and cos.dtype == hidden_states.dtype
        and cos.shape[-1] == attn.head_dim
        and kv._k.dtype == hidden_states.dtype
        and getattr(attn.config, "_attn_implementation", None) == attention.NAME
    )
    if not runs:
        return self._unfused_forward(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **named,
            **kwargs,
        )
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return torch.ops.flashdraft.decoder_layer(
        hidden_states.contiguous(),
        cos,
        sin,
        kv._k,
        kv._v,
        kv.static.columns,
        attention_mask,
        self.input_layernorm.weight,
        self.post_attention_layernorm.weight,
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        self.fused_qkv_packed,
        self.fused_qkv_scales,
        self.fused_qkv_colsums,
        self.fused_qkv_bias,
        self.fused_o_packed,
        self.fused_o_scales,
        self.fused_o_colsums,
        self.fused_o_bias,
        self.fused_gu_packed,
        self.fused_gu_scales,
        self.fused_gu_colsums,
        self.fused_gu_bias,
        self.fused_down_packed,
        self.fused_down_scales,
        self.fused_down_colsums,
        self.fused_down_bias,
        attn.config.num_attention_heads,
        attn.config.num_key_value_heads,
        attn.head_dim,
        mlp.down_proj.in_features,
        float(self.input_layernorm.variance_epsilon),
        float(attn.scaling),
    )
