"""One C++ operator for a whole decoder layer of a `--quantize w8a16` target at decode: a Llama-style pre-norm layer
(RMSNorm, q / k / v, RoPE, the static cache's write, attention, o, RMSNorm, SiLU-gated MLP, the two residuals) in
one call from a compiled graph, where inductor's graph made eight: four w8a16 products, the attention and three
kernels of its own (the norms, RoPE with the cache's write, SiLU x up), each with its Python call, its checks and
its views. On a 2-core Emerald Rapids Xeon half of a one-token step of SmolLM2-135M was the first thread's Python
and torch's dispatch while the second waited (`perf`, benchmarks/README.md, stop 75); 37 % of it lay outside the
operators (stop 76).

The operator calls the w8a16 product (w8a16_cpp.py) and the short-query attention (attention_cpp.py) through
torch's dispatcher, and does the rest in plain loops, each query row alone:

    x   = rms(hidden) * w_in                      fp32, rounded once
    q, k, v = x @ W_qkv   (q_norm / k_norm per head where the layer has them)
    q, k = RoPE(q, k; cos, sin)                   fp32, rounded once
    cache[columns] = k, v;   a = attention(q, cache, mask)
    h   = hidden + a @ W_o;   y = rms(h) * w_post
    out = h + (silu(y @ W_gate) * (y @ W_up)) @ W_down       silu x up in fp32, rounded once

Each step's result for a row depends on that row alone (the products are exact integer sums, the attention's bits
do not depend on the rows beside it), so a verify of n tokens gives each token the bits of a one-token step and
DFlash stays plain decoding bit for bit. Each tensor the layer stores is rounded to bf16 once, from fp32, but its
sums run in other orders than those of inductor's graph of the unfused layer, so the two give other bits
(SmolLM2-135M: the drafter's features about 4 % from the fp32 model's either way, benchmarks/README.md): the layer is
used alike by every decode step of a target (`fuse`, at `--compile`), never for some steps and not others.

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

from . import attention
from . import attention_cpp as cpu_attention
from . import cpp_build as cpp_library
from . import w8a16_cpp as cpu_w8a16

# transformers' layer classes whose forward is the pre-norm layer above (their attention: q / k / v / o, optionally
# q_norm / k_norm over each head; their MLP: gate / up / down)
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")

# The layer's element-wise parts (norms, RoPE and the cache's write, SiLU, the residuals) are split between the
# threads from this many rows (a verify's tokens, a batch's rows); fewer run on the calling thread.
PARALLEL_ROWS = 4

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {
using bf16 = at::BFloat16;
inline float f(bf16 x) { return static_cast<float>(x); }
inline bf16 r(float x) { return static_cast<bf16>(x); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& colsums,
                  const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashdraft::w8a16_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&)>();
  return op.call(x, packed, scales, colsums, bias);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashdraft::short_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, double)>();
  return op.call(q, k, v, mask, scale);
}

using Vf = at::vec::Vectorized<float>;
using Vb = at::vec::Vectorized<bf16>;  // twice Vf's lanes
constexpr int64_t L = Vb::size();

// apply `fn` (two Vf halves in, one bf16 vector out) over n elements, the tail by count
template <typename Fn>
inline void each(int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + L <= n; i += L) fn(i, L);
  if (i < n) fn(i, n - i);
}
inline std::tuple<Vf, Vf> load(const bf16* p, int64_t count) {
  return at::vec::convert_to_float<bf16>(count == L ? Vb::loadu(p) : Vb::loadu(p, count));
}
inline void store(bf16* p, const Vf& lo, const Vf& hi, int64_t count) {
  Vb v = at::vec::convert_from_float<bf16>(lo, hi);
  if (count == L) v.store(p);
  else v.store(p, count);
}

// RMSNorm: w * x * rsqrt(mean(x^2) + eps) in fp32, rounded once
inline void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  Vf acc(0.f);
  each(n, [&](int64_t i, int64_t c) {  // a tail's missing lanes load as zeros
    auto [lo, hi] = load(x + i, c);
    acc = at::vec::fmadd(lo, lo, acc);
    acc = at::vec::fmadd(hi, hi, acc);
  });
  const float sum = at::vec::vec_reduce_all<float>([](Vf& a, Vf& b) { return a + b; }, acc);
  const Vf scale(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  each(n, [&](int64_t i, int64_t c) {
    auto [lo, hi] = load(x + i, c);
    auto [wlo, whi] = load(w + i, c);
    store(out + i, wlo * (lo * scale), whi * (hi * scale), c);
  });
}

// out = a + b, each rounded to bf16
inline void add(const bf16* a, const bf16* b, bf16* out, int64_t n) {
  each(n, [&](int64_t i, int64_t c) {
    auto [alo, ahi] = load(a + i, c);
    auto [blo, bhi] = load(b + i, c);
    store(out + i, alo + blo, ahi + bhi, c);
  });
}

// out = silu(gate) * up in fp32, rounded once: transformers' act_fn(gate_proj(x)) * up_proj(x)
inline void silu_mul(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  const Vf one(1.f);
  each(n, [&](int64_t i, int64_t c) {
    auto [glo, ghi] = load(gate + i, c);
    auto [ulo, uhi] = load(up + i, c);
    store(out + i, glo / (one + glo.neg().exp_u20()) * ulo, ghi / (one + ghi.neg().exp_u20()) * uhi, c);
  });
}

// one head's RoPE in place: rotate_half's pairs (i, i + d/2), fp32 (a product each, then their sum), rounded once
inline void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  const int64_t half = d / 2;
  each(half, [&](int64_t i, int64_t c) {
    auto [alo, ahi] = load(x + i, c);
    auto [blo, bhi] = load(x + half + i, c);
    auto [clo, chi] = load(cos + i, c);
    auto [slo, shi] = load(sin + i, c);
    auto [c2lo, c2hi] = load(cos + half + i, c);
    auto [s2lo, s2hi] = load(sin + half + i, c);
    store(x + i, alo * clo - blo * slo, ahi * chi - bhi * shi, c);
    store(x + half + i, blo * c2lo + alo * s2lo, bhi * c2hi + ahi * s2hi, c);
  });
}

// fn(m) for the rows m in [0, M): split between the threads from PARALLEL_ROWS rows (each row alone, so its bits do
// not depend on the split)
template <typename Fn>
inline void each_row(int64_t M, Fn fn) {
  if (M < @PARALLEL_ROWS@) {
    for (int64_t m = 0; m < M; ++m) fn(m);
    return;
  }
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fn(m);
  });
}

// hidden [b, n, H]; cos / sin [b | 1, n, d]; key_cache / value_cache [b, kv_heads, capacity, d] (written at
// `columns` [n]); mask [b | 1, 1 | heads, n | 1, >= width] bool or added -> the layer's output [b, n, H]
at::Tensor decoder_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& columns,
                         const at::Tensor& mask, const at::Tensor& norm_in, const at::Tensor& norm_post,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                         const at::Tensor& qkv_packed, const at::Tensor& qkv_scales, const at::Tensor& qkv_colsums,
                         const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_packed,
                         const at::Tensor& o_scales, const at::Tensor& o_colsums,
                         const std::optional<at::Tensor>& o_bias, const at::Tensor& gu_packed,
                         const at::Tensor& gu_scales, const at::Tensor& gu_colsums,
                         const std::optional<at::Tensor>& gu_bias, const at::Tensor& down_packed,
                         const at::Tensor& down_scales, const at::Tensor& down_colsums,
                         const std::optional<at::Tensor>& down_bias, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t intermediate, double eps, double scale) {
  constexpr const char* op = "flashdraft::decoder_layer: ";
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous() && hidden.scalar_type() == at::kBFloat16, op,
              "hidden must be contiguous bf16 [b, n, H]");
  const int64_t b = hidden.size(0), n = hidden.size(1), H = hidden.size(2), d = head_dim, M = b * n;
  const int64_t qw = heads * d, kw = kv_heads * d, width = qw + 2 * kw;
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(1) == n && cos.size(2) == d &&
                  (cos.size(0) == 1 || cos.size(0) == b) && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16,
              op, "cos / sin must be bf16 [b | 1, n, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(0) == b && key_cache.size(1) == kv_heads &&
                  key_cache.size(3) == d && key_cache.stride(3) == 1 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.stride(3) == 1 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16,
              op, "the caches must be bf16 [b, kv_heads, capacity, head_dim]");
  TORCH_CHECK(columns.dim() == 1 && columns.size(0) == n && columns.scalar_type() == at::kLong, op,
              "columns must be [n] long");
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous(), cols = columns.contiguous();
  const int64_t capacity = key_cache.size(2);
  const int64_t* col = cols.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(col[t] >= 0 && col[t] < capacity, op, "a column is outside the cache");

  // x = norm(hidden); q / k / v in one product
  at::Tensor x = at::empty({M, H}, hidden.options());
  const bf16* h = hidden.data_ptr<bf16>();
  const float eps_f = static_cast<float>(eps);
  each_row(M, [&](int64_t m) { rms_norm(h + m * H, norm_in.data_ptr<bf16>(), x.data_ptr<bf16>() + m * H, H, eps_f); });
  at::Tensor qkv = linear(x, qkv_packed, qkv_scales, qkv_colsums, qkv_bias);  // [M, qw + 2 kw]

  // per-head norms, RoPE; the query rows apart [b, n, heads, d]; the cache's write
  at::Tensor q = at::empty({b, n, heads, d}, hidden.options());
  bf16* qp = q.data_ptr<bf16>();
  bf16* kc = key_cache.data_ptr<bf16>();
  bf16* vc = value_cache.data_ptr<bf16>();
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs2 = value_cache.stride(2);
  const bf16* qn = q_norm.has_value() ? q_norm->data_ptr<bf16>() : nullptr;
  const bf16* kn = k_norm.has_value() ? k_norm->data_ptr<bf16>() : nullptr;
  each_row(M, [&](int64_t m) {
    thread_local std::vector<bf16> head;  // a key head between its norm, RoPE and the cache (each thread its own)
    head.resize(d);
    const int64_t row = m / n, t = m % n, c = cos.size(0) == 1 ? t : m;
    const bf16* src = qkv.data_ptr<bf16>() + m * width;
    const bf16* cs = cos_c.data_ptr<bf16>() + c * d;
    const bf16* sn = sin_c.data_ptr<bf16>() + c * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      bf16* dst = qp + m * qw + hh * d;
      if (qn) rms_norm(src + hh * d, qn, dst, d, eps_f);
      else std::copy(src + hh * d, src + (hh + 1) * d, dst);
      rope(dst, cs, sn, d);
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      bf16* kdst = kc + row * ks0 + g * ks1 + col[t] * ks2;
      const bf16* ksrc = src + qw + g * d;
      if (kn) rms_norm(ksrc, kn, head.data(), d, eps_f);
      else std::copy(ksrc, ksrc + d, head.data());
      rope(head.data(), cs, sn, d);
      std::copy(head.begin(), head.end(), kdst);
      const bf16* vsrc = src + qw + kw + g * d;
      std::copy(vsrc, vsrc + d, vc + row * vs0 + g * vs1 + col[t] * vs2);
    }
  });
  qkv.reset();

  // attention over the columns the mask covers (the cache's capacity at most)
  const at::Tensor m4 = mask.size(3) > capacity ? mask.narrow(3, 0, capacity) : mask;
  at::Tensor a = attend(q.transpose(1, 2), key_cache, value_cache, m4, scale);  // [b, n, heads, d]
  at::Tensor o = linear(a.view({M, qw}), o_packed, o_scales, o_colsums, o_bias);  // [M, H]
  a.reset();

  // h = hidden + o; y = norm(h); the MLP; out = h + down
  at::Tensor out = at::empty({b, n, H}, hidden.options());
  bf16* out_ = out.data_ptr<bf16>();
  each_row(M, [&](int64_t m) {
    add(h + m * H, o.data_ptr<bf16>() + m * H, out_ + m * H, H);
    rms_norm(out_ + m * H, norm_post.data_ptr<bf16>(), x.data_ptr<bf16>() + m * H, H, eps_f);
  });
  at::Tensor gu = linear(x, gu_packed, gu_scales, gu_colsums, gu_bias);  // [M, 2 I]: gate, then up
  at::Tensor act = at::empty({M, intermediate}, hidden.options());
  each_row(M, [&](int64_t m) {
    const bf16* gate = gu.data_ptr<bf16>() + m * 2 * intermediate;
    silu_mul(gate, gate + intermediate, act.data_ptr<bf16>() + m * intermediate, intermediate);
  });
  gu.reset();
  at::Tensor down = linear(act, down_packed, down_scales, down_colsums, down_bias);
  each_row(M, [&](int64_t m) { add(out_ + m * H, down.data_ptr<bf16>() + m * H, out_ + m * H, H); });
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
"""

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


def prepare() -> bool:
    """Build (or load from inductor's cache) the library, once the two kernels it calls are built; whether the
    operator serves. Outside any graph being traced."""
    global _built, _loaded
    if _built is None:
        _built = False
        if not (cpu_w8a16.prepare() and cpu_attention.prepare(torch.bfloat16)):
            return False
        _loaded = cpp_library.load(
            _SOURCE.replace("@PARALLEL_ROWS@", str(PARALLEL_ROWS)), "the fused decoder layer"
        )
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
        m.colsums = colsums[tiles * cpu_w8a16.TILE_COLUMNS : (tiles + t) * cpu_w8a16.TILE_COLUMNS]
        m.scales = scales[cols : cols + m.out_features]
        if m.bias is not None:
            m.bias = bias[cols : cols + m.out_features]
        tiles, cols = tiles + t, cols + m.out_features
    for field, t in (("packed", packed), ("scales", scales), ("colsums", colsums), ("bias", bias)):
        layer.register_buffer(f"fused_{part}_{field}", t, persistent=False)


def refusal(layer: nn.Module) -> str | None:
    """Why `layer` cannot run as the fused operator (None: it can)."""
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
        if getattr(norm, "weight", None) is None or norm.weight.dtype != torch.bfloat16:
            return "norms without bf16 weights"
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
    if any(m.out_features % cpu_w8a16.TILE_COLUMNS for m in joined):
        return "widths that fill no whole tile"
    if d % 2:
        return "an odd head dimension"
    return None


def fuse(model: nn.Module) -> int:
    """Give each decoder layer of `model` that the operator runs exactly a forward through it at decode (the static
    cache, a short query, bf16, the mask a 4-D tensor); the number of layers fused. Idempotent."""
    if not prepare():
        return 0
    fused = 0
    for layer in model.modules():
        if hasattr(layer, "_unfused_forward"):
            fused += 1
            continue
        if refusal(layer) is not None:
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
        and hidden_states.dtype == torch.bfloat16
        and hidden_states.shape[1] <= attention.SHORT_QUERY
        and attention_mask is not None  # the static cache's mask, which the attention kernel reads
        and attention.kernel_serves(attn, hidden_states, attention_mask, hidden_states.shape[1])
        and cos is not None
        and cos.dtype == torch.bfloat16
        and cos.shape[-1] == attn.head_dim
        and kv._k.dtype == torch.bfloat16
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
