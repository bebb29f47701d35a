// flashdraft::w8a16_linear: int8 weights times rows held as 16-bit integers (kernels/w8a16_cpp.py builds it)

#include <torch/csrc/inductor/cpp_prefix.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
#define W8A16_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define W8A16_AMX 1
#endif
#endif

namespace flashdraft_w8a16 {
int vnni_rows = 4;   // code rows (two per input row) up to which vpdpbusd serves where AMX could
bool amx = false;    // AMX's tiles granted to the process (flashdraft_w8a16_isa)
int64_t prefetch = @PREFETCH@;  // bytes ahead in each weight stream the kernels ask for (0: none)
}

// 0: no kernel in this build; 1: avx512_vnni; 2: avx512_vnni and AMX (`amx_granted`: the process may use its tiles)
extern "C" int flashdraft_w8a16_isa(int amx_granted) {
#if defined(W8A16_AMX)
  flashdraft_w8a16::amx = amx_granted != 0;
  return amx_granted ? 2 : 1;
#elif defined(W8A16_VNNI)
  return 1;
#else
  return 0;
#endif
}
extern "C" void flashdraft_w8a16_vnni_rows(int rows) { flashdraft_w8a16::vnni_rows = rows; }
extern "C" void flashdraft_w8a16_prefetch(int bytes) { flashdraft_w8a16::prefetch = bytes; }

#ifdef W8A16_VNNI
namespace {
constexpr float HALF = @HALF@.f;

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline __mmask16 first(int64_t count) { return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }

// Row r of x -> code rows 2r (high halves) and 2r + 1 (low), K codes each (the rest of Kp left as it is), and the
// row's scale. Rounding to nearest even, as nearbyint. `add`: 128 stores each code as the unsigned byte code + 128
// (what vpdpbusd reads), 0 as the signed code (AMX's tdpbssd).
template <typename X>
void quantize(const X* x, int64_t K, int64_t Kp, int8_t* hi, float* scale, int add) {
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load16(x + k, first(K - k));
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float t = _mm512_reduce_max_ps(top);
  // a row with NaN or inf gives NaN outputs (codes of zero times a NaN or infinite scale), as a float GEMM would
  const bool finite = nan == 0 && std::isfinite(t);
  *scale = !finite ? (nan ? std::nanf("") : t) : t > 0.f ? t / HALF : 0.f;
  const __m512 inv = _mm512_set1_ps(finite && t > 0.f ? HALF / t : 0.f);
  int8_t* lo = hi + Kp;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = first(K - k);
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + k, m), inv));
    const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, _mm512_set1_epi32(128)),
                                                        _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
    const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(v, l), 8);
    const __m512i shift = _mm512_set1_epi32(add);
    _mm_mask_storeu_epi8(hi + k, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(h, shift)));
    _mm_mask_storeu_epi8(lo + k, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(l, shift)));
  }
}

// Ask for the line at byte `at` of weight stream i (blocks `stride` bytes apart from w), or past that stream's end the
// same line of the next group's stream i (four blocks on). Each thread reads four streams of KC KiB at a time, and
// the hardware's prefetchers stop at every 4 KiB page: asked 2 KiB ahead, SmolLM2-135M's verify of 1-16 tokens took
// 4-15 % less time on a 2-core Emerald Rapids Xeon, interleaved (benchmarks/README.md, 2026-12-06).
inline void prefetch_line(const int8_t* w, int64_t stride, int i, int64_t at) {
  if (at >= stride) w += 4 * stride, at -= stride;
  _mm_prefetch(reinterpret_cast<const char*>(w + i * stride + at), _MM_HINT_T0);
}

// Code rows [R] x columns of blocks b .. b + g - 1 (g <= 4), all of K: vpdpbusd on unsigned codes, the 128 * column
// sum taken back. c: [R][64] int32.
template <int R>
void vnni_blocks(const int8_t* codes, int64_t Kp, const int8_t* w, int64_t KC, const int32_t* colsum, int64_t b,
                 int64_t g, int32_t* c) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_si512();
  const int8_t* wb = w + b * KC * 1024;
  const int64_t quads = KC * 16, stride = KC * 1024;
  const int64_t ahead = flashdraft_w8a16::prefetch;
  for (int64_t q = 0; q < quads; ++q) {
    if (ahead > 0)
      for (int i = 0; i < 4; ++i) prefetch_line(wb, stride, i, q * 64 + ahead);
    __m512i a[R];
    for (int r = 0; r < R; ++r)
      a[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(codes + r * Kp + q * 4));
    const int8_t* wq = wb + q * 64;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (i >= g) break;
      const __m512i wv = _mm512_loadu_si512(wq + i * stride);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], a[r], wv);
    }
  }
  for (int64_t i = 0; i < g; ++i) {
    const __m512i back = _mm512_slli_epi32(_mm512_loadu_si512(colsum + (b + i) * 16), 7);
    for (int r = 0; r < R; ++r) _mm512_storeu_si512(c + r * 64 + i * 16, _mm512_sub_epi32(acc[r][i], back));
  }
}

#ifdef W8A16_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 16 code rows x blocks b .. b + G - 1: accumulators in tiles 0..G-1, the codes in tile 4, the weights in 5-7.
template <int G>
void amx_blocks(const int8_t* a, int64_t Kp, const int8_t* w, int64_t KC, int32_t* c) {
  if constexpr (G > 0) _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t stride = KC * 1024;
  const int64_t ahead = flashdraft_w8a16::prefetch;
  for (int64_t kc = 0; kc < KC; ++kc) {
    if (ahead > 0)
      for (int i = 0; i < G; ++i)
        for (int64_t l = 0; l < 1024; l += 64) prefetch_line(w, stride, i, kc * 1024 + ahead + l);
    _tile_loadd(4, a + kc * 64, Kp);
    const int8_t* b = w + kc * 1024;
    _tile_loadd(5, b, 64);
    _tile_dpbssd(0, 4, 5);
    if constexpr (G > 1) { _tile_loadd(6, b + stride, 64); _tile_dpbssd(1, 4, 6); }
    if constexpr (G > 2) { _tile_loadd(7, b + 2 * stride, 64); _tile_dpbssd(2, 4, 7); }
    if constexpr (G > 3) { _tile_loadd(5, b + 3 * stride, 64); _tile_dpbssd(3, 4, 5); }
  }
  if constexpr (G > 0) _tile_stored(0, c, 256);
  if constexpr (G > 1) _tile_stored(1, c + 16, 256);
  if constexpr (G > 2) _tile_stored(2, c + 32, 256);
  if constexpr (G > 3) _tile_stored(3, c + 48, 256);
}
#endif

// y[r][n] for the input rows of code rows c[0 .. 2 * rows) and columns n0 .. n0 + width (< N)
template <typename X>
void finish(const int32_t* c, int64_t rows, const float* scale, const float* ws, const float* bias, int64_t n0,
            int64_t width, X* y, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    for (int64_t x = 0; x < width; x += 16) {
      const __mmask16 m = first(width - x);
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + 2 * r * 64 + x));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + (2 * r + 1) * 64 + x));
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(hi, _mm512_set1_ps(256.f), lo), s),
                               _mm512_maskz_loadu_ps(m, ws + n0 + x));
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n0 + x));
      store16(y + r * N + n0 + x, v, m);
    }
  }
}

template <typename X>
void linear(const X* x, int64_t M, int64_t K, const int8_t* w, int64_t NB, int64_t KC, const float* ws,
            const int32_t* colsum, const float* bias, int64_t N, X* y) {
  const int64_t Kp = KC * 64;
#ifdef W8A16_AMX
  const bool tiles = flashdraft_w8a16::amx && 2 * M > flashdraft_w8a16::vnni_rows;
#else
  constexpr bool tiles = false;
#endif
  const int64_t code_rows = tiles ? (2 * M + 15) / 16 * 16 : (2 * M + 7) / 8 * 8;
  std::vector<int8_t> codes(code_rows * Kp, 0);
  std::vector<float> scale(M);
  for (int64_t r = 0; r < M; ++r)  // vpdpbusd reads unsigned codes: stored as code + 128 here, not flipped in its loop
    quantize(x + r * K, K, Kp, codes.data() + 2 * r * Kp, scale.data() + r, tiles ? 0 : 128);
  const int64_t threads = omp_get_max_threads();
  const bool parallel = threads > 1 && NB > 1 && NB * KC * 1024 * std::max<int64_t>(M, 4) >= (1 << 18);
#pragma omp parallel if (parallel)
  {
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t b0 = NB * id / team, b1 = NB * (id + 1) / team;
    alignas(64) int32_t c[16 * 64];
#ifdef W8A16_AMX
    if (tiles) {
      TileConfig config;
      for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
      _tile_loadconfig(&config);
    }
#endif
    for (int64_t b = b0; b < b1; b += 4) {
      const int64_t g = std::min<int64_t>(4, b1 - b), n0 = b * 16, width = std::min(g * 16, N - n0);
      if (width <= 0) break;
      if (tiles) {
#ifdef W8A16_AMX
        for (int64_t m0 = 0; m0 < code_rows; m0 += 16) {
          const int8_t* a = codes.data() + m0 * Kp;
          const int8_t* wb = w + b * KC * 1024;
          if (g == 4) amx_blocks<4>(a, Kp, wb, KC, c);
          else if (g == 3) amx_blocks<3>(a, Kp, wb, KC, c);
          else if (g == 2) amx_blocks<2>(a, Kp, wb, KC, c);
          else amx_blocks<1>(a, Kp, wb, KC, c);
          const int64_t rows = std::min<int64_t>(8, M - m0 / 2);
          finish(c, rows, scale.data() + m0 / 2, ws, bias, n0, width, y + (m0 / 2) * N, N);
        }
#endif
      } else {
        for (int64_t m0 = 0; m0 < 2 * M; m0 += 8) {
          const int8_t* a = codes.data() + m0 * Kp;
          const int64_t left = 2 * M - m0;
          if (left <= 2) vnni_blocks<2>(a, Kp, w, KC, colsum, b, g, c);
          else if (left <= 4) vnni_blocks<4>(a, Kp, w, KC, colsum, b, g, c);
          else vnni_blocks<8>(a, Kp, w, KC, colsum, b, g, c);
          const int64_t rows = std::min<int64_t>(4, M - m0 / 2);
          finish(c, rows, scale.data() + m0 / 2, ws, bias, n0, width, y + (m0 / 2) * N, N);
        }
      }
    }
#ifdef W8A16_AMX
    if (tiles) _tile_release();
#endif
  }
}
}  // namespace
#endif

namespace {
// x [M, K] bf16 or fp32 (rows contiguous), packed [N/16, K/64, 16, 16, 4] int8 (cpu_w8a16.pack), scales [N] fp32,
// colsums [N/16 * 16] int32, bias [N] fp32 or none -> [M, N] in x's dtype (N the scales')
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& colsums, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "flashdraft::w8a16_linear: ";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, "the input must be 2-D and contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, "the input must be bf16 or fp32");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 4,
              op, "the weight must be packed by cpu_w8a16.pack");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KC = packed.size(1), N = scales.numel();
  TORCH_CHECK(K <= KC * 64 && K > (KC - 1) * 64, op, "the input has ", K, " features, the weight ", KC * 64);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous(), op,
              "scales must be fp32, one per output");
  TORCH_CHECK(N > 0 && N <= NB * 16 && N > (NB - 1) * 16, op, "the scales do not fit the packed weight");
  TORCH_CHECK(colsums.scalar_type() == at::kInt && colsums.is_contiguous() && colsums.numel() == NB * 16, op,
              "colsums must be int32, one per packed column");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, op,
                "bias must be fp32, one per output");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef W8A16_VNNI
  if (x.scalar_type() == at::kBFloat16)
    linear(x.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<int8_t>(), NB, KC, scales.data_ptr<float>(),
           colsums.data_ptr<int32_t>(), b, N, y.data_ptr<at::BFloat16>());
  else
    linear(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), NB, KC, scales.data_ptr<float>(),
           colsums.data_ptr<int32_t>(), b, N, y.data_ptr<float>());
#else
  TORCH_CHECK(false, op, "this CPU has no avx512_vnni kernel");
#endif
  return y;
}
}  // namespace

TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("w8a16_linear", &w8a16_linear); }
