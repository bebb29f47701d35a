// flashdraft::decoder_layer: a w8a16 target's whole decoder layer at decode (kernels/decoder_layer_cpp.py builds it)

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
constexpr int64_t L = Vb::size();     // elements a step: two Vf halves, in either element type
constexpr int64_t HALF = Vf::size();

// The layer's tensors are bf16 or fp32 (`T`): every step loads them as two fp32 halves, computes in fp32 and stores
// the result rounded once to T (bf16), or as it is (fp32).

// apply `fn` (two Vf halves in, one vector of T out) over n elements, the tail by count
template <typename Fn>
inline void each(int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + L <= n; i += L) fn(i, L);
  if (i < n) fn(i, n - i);
}
inline std::tuple<Vf, Vf> load(const bf16* p, int64_t count) {
  return at::vec::convert_to_float<bf16>(count == L ? Vb::loadu(p) : Vb::loadu(p, count));
}
inline std::tuple<Vf, Vf> load(const float* p, int64_t count) {
  if (count == L) return {Vf::loadu(p), Vf::loadu(p + HALF)};
  const int64_t lo = std::min(count, HALF), hi = count - lo;  // a tail's missing lanes load as zeros
  return {Vf::loadu(p, lo), hi > 0 ? Vf::loadu(p + HALF, hi) : Vf(0.f)};
}
inline void store(bf16* p, const Vf& lo, const Vf& hi, int64_t count) {
  Vb v = at::vec::convert_from_float<bf16>(lo, hi);
  if (count == L) v.store(p);
  else v.store(p, count);
}
inline void store(float* p, const Vf& lo, const Vf& hi, int64_t count) {
  if (count == L) {
    lo.store(p);
    hi.store(p + HALF);
    return;
  }
  const int64_t l = std::min(count, HALF), h = count - l;
  lo.store(p, l);
  if (h > 0) hi.store(p + HALF, h);
}

// RMSNorm: w * x * rsqrt(mean(x^2) + eps) in fp32, rounded once
template <typename T>
inline void rms_norm(const T* x, const T* w, T* out, int64_t n, float eps) {
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

// out = a + b, each rounded to T
template <typename T>
inline void add(const T* a, const T* b, T* out, int64_t n) {
  each(n, [&](int64_t i, int64_t c) {
    auto [alo, ahi] = load(a + i, c);
    auto [blo, bhi] = load(b + i, c);
    store(out + i, alo + blo, ahi + bhi, c);
  });
}

// out = silu(gate) * up in fp32, rounded once: transformers' act_fn(gate_proj(x)) * up_proj(x)
template <typename T>
inline void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const Vf one(1.f);
  each(n, [&](int64_t i, int64_t c) {
    auto [glo, ghi] = load(gate + i, c);
    auto [ulo, uhi] = load(up + i, c);
    store(out + i, glo / (one + glo.neg().exp_u20()) * ulo, ghi / (one + ghi.neg().exp_u20()) * uhi, c);
  });
}

// one head's RoPE in place: rotate_half's pairs (i, i + d/2), fp32 (a product each, then their sum), rounded once
template <typename T>
inline void rope(T* x, const T* cos, const T* sin, int64_t d) {
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

// hidden [b, n, H] bf16 or fp32; cos / sin [b | 1, n, d], the caches [b, kv_heads, capacity, d] (written at
// `columns` [n]) and the norms' weights in hidden's dtype; mask [b | 1, 1 | heads, n | 1, >= width] bool or added
// -> the layer's output [b, n, H]
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
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous() && (dtype == at::kBFloat16 || dtype == at::kFloat), op,
              "hidden must be contiguous bf16 or fp32 [b, n, H]");
  const int64_t b = hidden.size(0), n = hidden.size(1), d = head_dim;
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(1) == n && cos.size(2) == d &&
                  (cos.size(0) == 1 || cos.size(0) == b) && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              op, "cos / sin must be [b | 1, n, head_dim] in hidden's dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(0) == b && key_cache.size(1) == kv_heads &&
                  key_cache.size(3) == d && key_cache.stride(3) == 1 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.stride(3) == 1 && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              op, "the caches must be [b, kv_heads, capacity, head_dim] in hidden's dtype");
  TORCH_CHECK(columns.dim() == 1 && columns.size(0) == n && columns.scalar_type() == at::kLong, op,
              "columns must be [n] long");
  for (const at::Tensor* w : {&norm_in, &norm_post})
    TORCH_CHECK(w->is_contiguous() && w->scalar_type() == dtype && w->numel() == hidden.size(2), op,
                "the norms' weights must be [H] in hidden's dtype");
  for (const std::optional<at::Tensor>* w : {&q_norm, &k_norm})
    TORCH_CHECK(!w->has_value() || ((*w)->is_contiguous() && (*w)->scalar_type() == dtype && (*w)->numel() == d),
                op, "the heads' norms' weights must be [head_dim] in hidden's dtype");
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous(), cols = columns.contiguous();
  const int64_t capacity = key_cache.size(2);
  const int64_t* col = cols.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(col[t] >= 0 && col[t] < capacity, op, "a column is outside the cache");

  // the layer in element type T
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const int64_t H = hidden.size(2), M = b * n;
    const int64_t qw = heads * d, kw = kv_heads * d, width = qw + 2 * kw;

    // x = norm(hidden); q / k / v in one product
    at::Tensor x = at::empty({M, H}, hidden.options());
    const T* h = hidden.data_ptr<T>();
    const float eps_f = static_cast<float>(eps);
    each_row(M, [&](int64_t m) { rms_norm(h + m * H, norm_in.data_ptr<T>(), x.data_ptr<T>() + m * H, H, eps_f); });
    at::Tensor qkv = linear(x, qkv_packed, qkv_scales, qkv_colsums, qkv_bias);  // [M, qw + 2 kw]

    // per-head norms, RoPE; the query rows apart [b, n, heads, d]; the cache's write
    at::Tensor q = at::empty({b, n, heads, d}, hidden.options());
    T* qp = q.data_ptr<T>();
    T* kc = key_cache.data_ptr<T>();
    T* vc = value_cache.data_ptr<T>();
    const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
    const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs2 = value_cache.stride(2);
    const T* qn = q_norm.has_value() ? q_norm->data_ptr<T>() : nullptr;
    const T* kn = k_norm.has_value() ? k_norm->data_ptr<T>() : nullptr;
    each_row(M, [&](int64_t m) {
      thread_local std::vector<T> head;  // a key head between its norm, RoPE and the cache (each thread its own)
      head.resize(d);
      const int64_t row = m / n, t = m % n, c = cos.size(0) == 1 ? t : m;
      const T* src = qkv.data_ptr<T>() + m * width;
      const T* cs = cos_c.data_ptr<T>() + c * d;
      const T* sn = sin_c.data_ptr<T>() + c * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* dst = qp + m * qw + hh * d;
        if (qn) rms_norm(src + hh * d, qn, dst, d, eps_f);
        else std::copy(src + hh * d, src + (hh + 1) * d, dst);
        rope(dst, cs, sn, d);
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        T* kdst = kc + row * ks0 + g * ks1 + col[t] * ks2;
        const T* ksrc = src + qw + g * d;
        if (kn) rms_norm(ksrc, kn, head.data(), d, eps_f);
        else std::copy(ksrc, ksrc + d, head.data());
        rope(head.data(), cs, sn, d);
        std::copy(head.begin(), head.end(), kdst);
        const T* vsrc = src + qw + kw + g * d;
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
    T* out_ = out.data_ptr<T>();
    each_row(M, [&](int64_t m) {
      add(h + m * H, o.data_ptr<T>() + m * H, out_ + m * H, H);
      rms_norm(out_ + m * H, norm_post.data_ptr<T>(), x.data_ptr<T>() + m * H, H, eps_f);
    });
    at::Tensor gu = linear(x, gu_packed, gu_scales, gu_colsums, gu_bias);  // [M, 2 I]: gate, then up
    at::Tensor act = at::empty({M, intermediate}, hidden.options());
    each_row(M, [&](int64_t m) {
      const T* gate = gu.data_ptr<T>() + m * 2 * intermediate;
      silu_mul(gate, gate + intermediate, act.data_ptr<T>() + m * intermediate, intermediate);
    });
    gu.reset();
    at::Tensor down = linear(act, down_packed, down_scales, down_colsums, down_bias);
    each_row(M, [&](int64_t m) { add(out_ + m * H, down.data_ptr<T>() + m * H, out_ + m * H, H); });
    return out;
  };
  return dtype == at::kFloat ? run(float{}) : run(bf16{});
}
}  // namespace

TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
