// flashdraft::w8a16_linear: int8 weights times rows held as 16-bit integers (kernels/w8a16_cpp.py builds it)

#include <torch/csrc/inductor/cpp_prefix.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include <cstring>

// The kernels this build has. Every one gives a row the same integer product S, exact, rounded once to fp32 and
// scaled the same way, so all give the same bits (w8a16_cpp.py's docstring).
#if defined(__AVX2__) && defined(__FMA__)
#define W8A16_AVX2 1
#if defined(__AVXVNNI__)
#define W8A16_AVXVNNI 1
#endif
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define W8A16_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define W8A16_AMX 1
#endif
#endif

namespace flashdraft_w8a16 {
enum Kernel { NONE = 0, AVX2 = 1, AVX_VNNI = 2, AVX512_VNNI = 3, AMX = 4 };
int kernel = NONE;   // the kernel serving (flashdraft_w8a16_isa)
int vnni_rows = 4;   // code rows (two per input row) up to which vpdpbusd serves where AMX could
int64_t prefetch = @PREFETCH@;  // bytes ahead in each weight stream the kernels ask for (0: none)
}

// The kernels of this build this CPU may run, a bit per Kernel (AMX's only where `amx_granted`: the process may use
// its tiles). A CPU may have a later one without an earlier: a Zen 4 has avx512_vnni and no AVX-VNNI.
extern "C" int flashdraft_w8a16_built(int amx_granted) {
  using namespace flashdraft_w8a16;
  int built = 0;
#if defined(W8A16_AVX2)
  built |= 1 << AVX2;
#endif
#if defined(W8A16_AVXVNNI)
  built |= 1 << AVX_VNNI;
#endif
#if defined(W8A16_VNNI)
  built |= 1 << AVX512_VNNI;
#endif
#if defined(W8A16_AMX)
  if (amx_granted) built |= 1 << AMX;
#endif
  return built;
}

// The best of those at most `most` (a Kernel; tests and benchmarks ask for a lesser one) serves from now on, and is
// returned (NONE where there is none).
extern "C" int flashdraft_w8a16_isa(int amx_granted, int most) {
  using namespace flashdraft_w8a16;
  const int built = flashdraft_w8a16_built(amx_granted);
  kernel = NONE;
  for (int k = most; k > NONE; --k)
    if (built >> k & 1) {
      kernel = k;
      break;
    }
  return kernel;
}
extern "C" void flashdraft_w8a16_vnni_rows(int rows) { flashdraft_w8a16::vnni_rows = rows; }
extern "C" void flashdraft_w8a16_prefetch(int bytes) { flashdraft_w8a16::prefetch = bytes; }

namespace {
constexpr float HALF = @HALF@.f;

#ifdef W8A16_AVX2
// Ask for the line at byte `at` of weight stream i (blocks `stride` bytes apart from w), or past that stream's end the
// same line of the next group's stream i (`group` blocks on). Each thread reads `group` streams of KC KiB at a time,
// and the hardware's prefetchers stop at every 4 KiB page: asked 2 KiB ahead, SmolLM2-135M's verify of 1-16 tokens
// took 4-15 % less time on a 2-core Emerald Rapids Xeon, interleaved (benchmarks/README.md, 2026-12-06).
inline void prefetch_line(const int8_t* w, int64_t stride, int i, int64_t at, int group = 4) {
  if (at >= stride) w += group * stride, at -= stride;
  _mm_prefetch(reinterpret_cast<const char*>(w + i * stride + at), _MM_HINT_T0);
}

// ---- 256-bit vectors: avx2 with FMA (Haswell on, Zen 1 on), and AVX-VNNI's vpdpbusd where the CPU has it

// count (< 8) lanes or all eight
inline __m256i lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load8(const float* p, int64_t count) {
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(count));
}
inline __m256 load8(const at::BFloat16* p, int64_t count) {
  __m128i h;
  if (count >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {};
    std::memcpy(t, p, count * 2);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v, int64_t count) {
  if (count >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes(count), v);
}
// fp32 -> bf16 as avx512_bf16's vcvtneps2bf16 rounds (the wide kernels' store16): to nearest even, a subnormal input
// read as a zero of its sign, a NaN made quiet
inline void store8(at::BFloat16* p, __m256 v, int64_t count) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                                               _mm256_setzero_si256());
  u = _mm256_blendv_epi8(u, _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))), subnormal);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  if (count >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), packed);
    std::memcpy(p, t, count * 2);
  }
}
// eight int32 lanes' low bytes to p[0 .. count)
inline void store_bytes(int8_t* p, __m256i v, int64_t count) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(v, pick);
  const __m128i both = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  if (count >= 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), both);
  } else {
    alignas(16) int8_t t[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), both);
    std::memcpy(p, t, count);
  }
}
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The wide kernels' `quantize` (below), eight lanes at a time: the same codes and scale. `split`: as code rows of
// hi and lo bytes (each + add); else as one row of 16-bit codes, x16 (at hi, read as int16_t[Kp]).
template <typename X>
void quantize8(const X* x, int64_t K, int64_t Kp, int8_t* hi, float* scale, int add, bool split) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps();
  int nan = 0;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = load8(x + k, K - k);
    top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const float t = max8(top);
  const bool finite = nan == 0 && std::isfinite(t);
  *scale = !finite ? (nan ? std::nanf("") : t) : t > 0.f ? t / HALF : 0.f;
  const __m256 inv = _mm256_set1_ps(finite && t > 0.f ? HALF / t : 0.f);
  int8_t* lo = hi + Kp;
  const __m256i shift = _mm256_set1_epi32(add), offset = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k, K - k), inv));
    if (!split) {
      const __m128i x16 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0x08));
      alignas(16) int16_t t[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(t), x16);
      std::memcpy(reinterpret_cast<int16_t*>(hi) + k, t, std::min<int64_t>(8, K - k) * 2);
      continue;
    }
    const __m256i l = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, offset), byte), offset);
    const __m256i h = _mm256_srai_epi32(_mm256_sub_epi32(v, l), 8);
    store_bytes(hi + k, _mm256_add_epi32(h, shift), K - k);
    store_bytes(lo + k, _mm256_add_epi32(l, shift), K - k);
  }
}

// AVX-VNNI: code rows [R] x blocks b .. b + G - 1 of the group starting at `wb` (blocks `stride` bytes apart), all of
// K, into c ([R][64] int32, block i at column 16 i): vpdpbusd on unsigned codes (code + 128), 128 times the column's
// sum taken back after, as the wide kernel does; a block's 64-byte line of a quad is two halves of 8 columns.
#ifdef W8A16_AVXVNNI
template <int R, int G>
void dp8_blocks(const int8_t* codes, int64_t Kp, const int8_t* wb, int64_t stride, int64_t KC, const int32_t* colsum,
                int32_t* c) {
  __m256i acc[R][G][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < G; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_si256();
  const int64_t quads = KC * 16, ahead = flashdraft_w8a16::prefetch;
  for (int64_t q = 0; q < quads; ++q) {
    if (ahead > 0)
      for (int i = 0; i < G; ++i) prefetch_line(wb, stride, i, q * 64 + ahead, G);
    __m256i wv[G][2];
    for (int i = 0; i < G; ++i)
      for (int h = 0; h < 2; ++h)
        wv[i][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * stride + q * 64 + h * 32));
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(codes + r * Kp + q * 4));
      for (int i = 0; i < G; ++i)
        for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm256_dpbusd_avx_epi32(acc[r][i][h], a, wv[i][h]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256i back =
          _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + i * 16 + h * 8)), 7);
      for (int r = 0; r < R; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * 64 + i * 16 + h * 8),
                            _mm256_sub_epi32(acc[r][i][h], back));
    }
}

// code rows a[0 .. min(left, 8)) x blocks b .. b + g - 1 (g <= 4) into c ([8][64]): a decode step's code row pair two
// blocks at a time, more rows four at a time a block at a time (16 ymm registers hold 8 sums)
void dp8_rows(const int8_t* a, int64_t Kp, const int8_t* w, int64_t KC, const int32_t* colsum, int64_t b, int64_t g,
              int64_t left, int32_t* c) {
  const int64_t stride = KC * 1024;
  const int8_t* wb = w + b * stride;
  const int32_t* cs = colsum + b * 16;
  if (left <= 2) {
    for (int64_t i = 0; i < g; i += 2) {
      if (g - i >= 2) dp8_blocks<2, 2>(a, Kp, wb + i * stride, stride, KC, cs + i * 16, c + i * 16);
      else dp8_blocks<2, 1>(a, Kp, wb + i * stride, stride, KC, cs + i * 16, c + i * 16);
    }
    return;
  }
  for (int64_t r = 0; r < std::min<int64_t>(left, 8); r += 4)
    for (int64_t i = 0; i < g; ++i)
      dp8_blocks<4, 1>(a + r * Kp, Kp, wb + i * stride, stride, KC, cs + i * 16, c + r * 64 + i * 16);
}
#endif

// avx2: input rows [R] of 16-bit codes x blocks b .. b + G - 1 (from `wb`, `stride` bytes apart), all of K, into d
// ([R][64] double, block i at column 16 i). A weight line's 16 bytes (4 columns x 4 inputs) widen to 16-bit
// (vpmovsxbw) and vpmaddwd multiplies them by the row's 4 codes, summing pairs to int32: x16 * w is at most
// 32639 * 127, so 512 inputs' sums stay below 2^31 and go to double (exact: integers below 2^53) every 128 quads.
// The same integer S = sum(x16 * w) as the split kernels' 256 H + L, with one vpmaddwd per 16 products where
// vpmaddubsw on split codes took four instructions per 32 for each of two code rows (1.6x slower at 4-16 rows).
constexpr int64_t CHUNK = 128;  // quads summed in int32 before they go to double
template <int R, int G>
void madd_blocks(const int16_t* codes, int64_t Kp, const int8_t* wb, int64_t stride, int64_t KC, double* d) {
  for (int r = 0; r < R; ++r)
    for (int64_t x = 0; x < G * 16; ++x) d[r * 64 + x] = 0.;
  const int64_t quads = KC * 16, ahead = flashdraft_w8a16::prefetch;
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t q0 = 0; q0 < quads; q0 += CHUNK) {
    __m256i acc[R][G][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < 4; ++j) acc[r][i][j] = _mm256_setzero_si256();
    for (int64_t q = q0; q < std::min(quads, q0 + CHUNK); ++q) {
      if (ahead > 0)
        for (int i = 0; i < G; ++i) prefetch_line(wb, stride, i, q * 64 + ahead, G);
      __m256i x[R];
      for (int r = 0; r < R; ++r) x[r] = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(codes + r * Kp + q * 4));
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < 4; ++j) {
          const __m256i wv =
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + i * stride + q * 64 + j * 16)));
          for (int r = 0; r < R; ++r) acc[r][i][j] = _mm256_add_epi32(acc[r][i][j], _mm256_madd_epi16(x[r], wv));
        }
    }
    // acc[.][.][j]'s lanes: columns 4j, 4j, 4j+1, 4j+1, ... (two pairs of inputs each): pairs summed, in column order
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < 4; j += 2) {
          const __m256i cols = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[r][i][j], acc[r][i][j + 1]), order);
          double* at = d + r * 64 + i * 16 + j * 4;
          _mm256_storeu_pd(at, _mm256_add_pd(_mm256_loadu_pd(at), _mm256_cvtepi32_pd(_mm256_castsi256_si128(cols))));
          _mm256_storeu_pd(at + 4,
                           _mm256_add_pd(_mm256_loadu_pd(at + 4), _mm256_cvtepi32_pd(_mm256_extracti128_si256(cols, 1))));
        }
  }
}

// input rows codes[0 .. min(left, 4)) (16-bit, Kp each) x blocks b .. b + g - 1 (g <= 4) into d ([4][64])
void madd_rows(const int16_t* codes, int64_t Kp, const int8_t* w, int64_t KC, int64_t b, int64_t g, int64_t left,
               double* d) {
  const int64_t stride = KC * 1024;
  const int8_t* wb = w + b * stride;
  if (left <= 1) {
    for (int64_t i = 0; i < g; i += 2) {
      if (g - i >= 2) madd_blocks<1, 2>(codes, Kp, wb + i * stride, stride, KC, d + i * 16);
      else madd_blocks<1, 1>(codes, Kp, wb + i * stride, stride, KC, d + i * 16);
    }
    return;
  }
  for (int64_t r = 0; r < std::min<int64_t>(left, 4); r += 2)
    for (int64_t i = 0; i < g; ++i)
      madd_blocks<2, 1>(codes + r * Kp, Kp, wb + i * stride, stride, KC, d + r * 64 + i * 16);
}

// S (8 exact integers in double) -> y's lanes: rounded once to fp32, times the two scales, plus the bias
template <typename X>
inline void finish_lanes(__m256 sum, __m256 s, const float* ws, const float* bias, int64_t count, X* y) {
  __m256 v = _mm256_mul_ps(_mm256_mul_ps(sum, s), load8(ws, count));
  if (bias != nullptr) v = _mm256_add_ps(v, load8(bias, count));
  store8(y, v, count);
}
inline __m256 to_float(__m256d a, __m256d b) {
  return _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a));
}

// `finish` (the wide kernels') eight lanes at a time from the split sums c (AVX-VNNI): the same bits
template <typename X>
void finish8(const int32_t* c, int64_t rows, const float* scale, const float* ws, const float* bias, int64_t n0,
             int64_t width, X* y, int64_t N) {
  const __m256d step = _mm256_set1_pd(256.);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    for (int64_t x = 0; x < width; x += 8) {
      __m256d half[2];
      for (int h = 0; h < 2; ++h) {
        const __m256d hi = _mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 2 * r * 64 + x + 4 * h)));
        const __m256d lo =
            _mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (2 * r + 1) * 64 + x + 4 * h)));
        half[h] = _mm256_fmadd_pd(hi, step, lo);
      }
      finish_lanes(to_float(half[0], half[1]), s, ws + n0 + x, bias == nullptr ? nullptr : bias + n0 + x, width - x,
                   y + r * N + n0 + x);
    }
  }
}

// the same from whole sums d ([rows][64] double, avx2)
template <typename X>
void finish8(const double* d, int64_t rows, const float* scale, const float* ws, const float* bias, int64_t n0,
             int64_t width, X* y, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    for (int64_t x = 0; x < width; x += 8)
      finish_lanes(to_float(_mm256_loadu_pd(d + r * 64 + x), _mm256_loadu_pd(d + r * 64 + x + 4)), s, ws + n0 + x,
                   bias == nullptr ? nullptr : bias + n0 + x, width - x, y + r * N + n0 + x);
  }
}
#endif  // W8A16_AVX2
#ifdef W8A16_VNNI

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

// y[r][n] for the input rows of code rows c[0 .. 2 * rows) and columns n0 .. n0 + width (< N): the row's integer
// product S = 256 H + L (exact in double) rounded once to fp32, times the two scales (`finish8` the same, 8 lanes)
template <typename X>
void finish(const int32_t* c, int64_t rows, const float* scale, const float* ws, const float* bias, int64_t n0,
            int64_t width, X* y, int64_t N) {
  const __m512d step = _mm512_set1_pd(256.);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    for (int64_t x = 0; x < width; x += 16) {
      const __mmask16 m = first(width - x);
      __m256 half[2];
      for (int h = 0; h < 2; ++h) {
        const __m512d hi = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 2 * r * 64 + x + 8 * h)));
        const __m512d lo =
            _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (2 * r + 1) * 64 + x + 8 * h)));
        half[h] = _mm512_cvtpd_ps(_mm512_fmadd_pd(hi, step, lo));
      }
      const __m512 sum = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(half[0])),
                                                             _mm256_castps_pd(half[1]), 1));
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(sum, s), _mm512_maskz_loadu_ps(m, ws + n0 + x));
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n0 + x));
      store16(y + r * N + n0 + x, v, m);
    }
  }
}

#endif  // W8A16_VNNI

#ifdef W8A16_AVX2
template <typename X>
void linear(const X* x, int64_t M, int64_t K, const int8_t* w, int64_t NB, int64_t KC, const float* ws,
            const int32_t* colsum, const float* bias, int64_t N, X* y) {
  using namespace flashdraft_w8a16;
  const int64_t Kp = KC * 64;
  const int kind = kernel;
#ifdef W8A16_AMX
  const bool tiles = kind == AMX && 2 * M > vnni_rows;
#else
  constexpr bool tiles = false;
#endif
  const bool wide = kind >= AVX512_VNNI;  // 512-bit vectors (else 256-bit)
  // vpdpbusd reads unsigned codes: stored as code + 128 here, not flipped in its loop; AMX signed ones
  const int add = !tiles && (kind == AVX512_VNNI || kind == AMX || kind == AVX_VNNI) ? 128 : 0;
  const int64_t code_rows = tiles ? (2 * M + 15) / 16 * 16 : (2 * M + 7) / 8 * 8;
  std::vector<int8_t> codes(code_rows * Kp, 0);
  std::vector<float> scale(M);
  for (int64_t r = 0; r < M; ++r) {
#ifdef W8A16_VNNI
    if (wide) {
      quantize(x + r * K, K, Kp, codes.data() + 2 * r * Kp, scale.data() + r, add);
      continue;
    }
#endif
    quantize8(x + r * K, K, Kp, codes.data() + 2 * r * Kp, scale.data() + r, add, kind != AVX2);
  }
  const int64_t threads = omp_get_max_threads();
  const bool parallel = threads > 1 && NB > 1 && NB * KC * 1024 * std::max<int64_t>(M, 4) >= (1 << 18);
#pragma omp parallel if (parallel)
  {
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t b0 = NB * id / team, b1 = NB * (id + 1) / team;
    alignas(64) int32_t c[16 * 64];
    alignas(64) double d[4 * 64];
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
        continue;
      }
      for (int64_t m0 = 0; m0 < 2 * M; m0 += 8) {
        const int8_t* a = codes.data() + m0 * Kp;
        const int64_t left = 2 * M - m0, rows = std::min<int64_t>(4, M - m0 / 2);
#ifdef W8A16_VNNI
        if (wide) {
          if (left <= 2) vnni_blocks<2>(a, Kp, w, KC, colsum, b, g, c);
          else if (left <= 4) vnni_blocks<4>(a, Kp, w, KC, colsum, b, g, c);
          else vnni_blocks<8>(a, Kp, w, KC, colsum, b, g, c);
          finish(c, rows, scale.data() + m0 / 2, ws, bias, n0, width, y + (m0 / 2) * N, N);
          continue;
        }
#endif
        if (kind == AVX2) {  // 16-bit codes: input row r at codes + 2 r Kp bytes
          madd_rows(reinterpret_cast<const int16_t*>(a), Kp, w, KC, b, g, left / 2, d);
          finish8(d, rows, scale.data() + m0 / 2, ws, bias, n0, width, y + (m0 / 2) * N, N);
          continue;
        }
#ifdef W8A16_AVXVNNI
        dp8_rows(a, Kp, w, KC, colsum, b, g, left, c);
#endif
        finish8(c, rows, scale.data() + m0 / 2, ws, bias, n0, width, y + (m0 / 2) * N, N);
      }
    }
#ifdef W8A16_AMX
    if (tiles) _tile_release();
#endif
  }
}
#endif  // W8A16_AVX2
}  // namespace

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
#ifdef W8A16_AVX2
  TORCH_CHECK(flashdraft_w8a16::kernel != flashdraft_w8a16::NONE, op, "no kernel serves (flashdraft_w8a16_isa)");
  if (x.scalar_type() == at::kBFloat16)
    linear(x.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<int8_t>(), NB, KC, scales.data_ptr<float>(),
           colsums.data_ptr<int32_t>(), b, N, y.data_ptr<at::BFloat16>());
  else
    linear(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), NB, KC, scales.data_ptr<float>(),
           colsums.data_ptr<int32_t>(), b, N, y.data_ptr<float>());
#else
  TORCH_CHECK(false, op, "this CPU has no avx2 and FMA kernel");
#endif
  return y;
}
}  // namespace

TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("w8a16_linear", &w8a16_linear); }
