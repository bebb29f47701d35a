// flashdraft::short_attention: a short query's whole attention on a CPU (kernels/attention_cpp.py builds it)

#include <torch/csrc/inductor/cpp_prefix.h>
#include <c10/util/Unroll.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTENTION_AMX 1
#endif

namespace flashdraft_attention {
bool amx = false;  // bf16 scores on AMX's tiles (flashdraft_attention_amx): set once, before any call
}

// Whether bf16 scores go to AMX from now on (`granted`: the process may use its tiles); whether they do.
extern "C" int flashdraft_attention_amx(int granted) {
#ifdef ATTENTION_AMX
  flashdraft_attention::amx = granted != 0;
#endif
  return flashdraft_attention::amx ? 1 : 0;
}

#ifdef ATTENTION_AMX
namespace flashdraft_attention {
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5 as 16 rows of 64 bytes (the caller releases them).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// The raw scores q_r . k_j (fp32) of up to 16 query rows of one KV head against columns [0, width), into
// s[r * s_row + j] (16 columns at a time; past width, zeros). One `tdpbf16ps` per 32 head dimensions with the keys as
// the tile's rows, read from the cache in place, and the queries as its columns: a score is a function of its query
// row and key column alone, whatever the rows, columns or width beside it. d = 32 CH: 64 or 128, the queries kept in tiles.
template <int CH>
inline void amx_scores(const at::BFloat16* const* q, int64_t rows, const at::BFloat16* k, int64_t width,
                       int64_t k_col, float* s, int64_t s_row) {
  constexpr int64_t d = 32 * CH;
  alignas(64) uint32_t qt[CH * 256];       // the queries in pairs: [d / 32][16 pairs][16 rows]
  alignas(64) at::BFloat16 pad[16 * d];    // the last block's keys, zeros past the last column
  alignas(64) float c[16 * 16];            // [key][query row]
  std::fill(qt, qt + CH * 256, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q[r]);
    for (int64_t p = 0; p < d / 2; ++p) qt[(p / 16) * 256 + (p % 16) * 16 + r] = qr[p];
  }
  // the queries stay in tiles 2 .. 2 + CH - 1 for every block of keys
  _tile_loadd(2, qt, 64);
  _tile_loadd(3, qt + 256, 64);
  if constexpr (CH > 2) {
    _tile_loadd(4, qt + 512, 64);
    _tile_loadd(5, qt + 768, 64);
  }
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t count = std::min<int64_t>(16, width - j);
    const at::BFloat16* a = k + j * k_col;
    int64_t stride = k_col * 2;
    if (count < 16) {
      std::fill(pad, pad + 16 * d, at::BFloat16(0.f));
      for (int64_t x = 0; x < count; ++x) std::copy(a + x * k_col, a + x * k_col + d, pad + x * d);
      a = pad, stride = d * 2;
    }
    _tile_zero(0);
    _tile_loadd(1, a, stride);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, a + 32, stride);
    _tile_dpbf16ps(0, 1, 3);
    if constexpr (CH > 2) {
      _tile_loadd(1, a + 64, stride);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, a + 96, stride);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, c, 64);
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(s + r * s_row + j, _mm512_i32gather_ps(column, c + r, 4));
  }
}

}  // namespace flashdraft_attention
#endif
// ==== flashdraft: the kernel, once per dtype (in namespace k_<dtype>, T its element type) ====

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline Vec load(const float* p, int64_t count) { return Vec::loadu(p, count); }
inline Vec load(const at::BFloat16* p, int64_t count) {
  return at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(p, count));
}
inline void store(float* p, const Vec& x, int64_t count) { x.store(p, count); }
inline void store(at::BFloat16* p, const Vec& x, int64_t count) { at::vec::convert<at::BFloat16>(x).store(p, count); }

// Whether the query sees column j, and what its mask adds to the score.
struct Causal {
  int64_t last;
  bool operator()(int64_t j, float& add) const { add = 0.f; return j <= last; }
};
struct Boolean {
  const bool* row;
  bool operator()(int64_t j, float& add) const { add = 0.f; return row[j]; }
};
struct Added {
  const T* row;
  bool operator()(int64_t j, float& add) const {
    add = static_cast<float>(row[j]);
    return add > static_cast<float>(std::numeric_limits<T>::lowest());
  }
};

// One query row of one head, any head widths and vector ISA: each column's score, then the values' sum over the
// columns in order (the general path; attend_rows below takes the usual widths on avx512).
template <typename Sees>
void attend_row(const T* q, const T* k, const T* v, T* out, const Sees& sees, int64_t width, int64_t d, int64_t dv,
                int64_t k_col, int64_t v_col, float scale, float* qf, float* s, float* acc) {
  for (int64_t c = 0; c < d; c += L) load(q + c, std::min(L, d - c)).store(qf + c);
  float top = NEG_INF;
  for (int64_t j = 0; j < width; ++j) {
    float add;
    if (!sees(j, add)) { s[j] = NEG_INF; continue; }
    const T* kc = k + j * k_col;
    Vec dot(0.f);
    for (int64_t c = 0; c < d; c += L) dot = at::vec::fmadd(Vec::loadu(qf + c), load(kc + c, std::min(L, d - c)), dot);
    const float x = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, dot) * scale + add;
    s[j] = x;
    top = std::max(top, x);
  }
  if (top == NEG_INF) {  // sees nothing (a padding row): zeros
    for (int64_t c = 0; c < dv; c += L) store(out + c, Vec(0.f), std::min(L, dv - c));
    return;
  }
  for (int64_t j = 0; j < width; j += L) {
    const int64_t count = std::min(L, width - j);
    (Vec::loadu(s + j, count) - Vec(top)).exp().store(s + j, count);
  }
  float total = 0.f;
  std::fill(acc, acc + dv, 0.f);
  for (int64_t j = 0; j < width; ++j) {
    const float e = s[j];
    if (e == 0.f) continue;  // hidden (or too small to count): adding it would add exact zeros
    total += e;
    const T* vc = v + j * v_col;
    const Vec ev(e);
    for (int64_t c = 0; c < dv; c += L) {
      const int64_t count = std::min(L, dv - c);
      at::vec::fmadd(ev, load(vc + c, count), Vec::loadu(acc + c, count)).store(acc + c, count);
    }
  }
  const Vec inv(total);
  for (int64_t c = 0; c < dv; c += L) {
    const int64_t count = std::min(L, dv - c);
    store(out + c, Vec::loadu(acc + c, count) / inv, count);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The sums of 16 vectors, vector p's in lane p. Every sum is taken in the order a horizontal sum of one vector
// takes (lanes l and l^8, then l^4, l^2, l^1), whichever its vector's place among the 16.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)  // lanes l + l^8: [vector 2m | vector 2m+1], 8 lanes each
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int t = 0; t < 4; ++t)  // l^4: 128-bit block k holds vector 4t + k
    c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0xDD));
  for (int u = 0; u < 2; ++u) {  // l^2: block k holds vectors 8u + k, 8u + 4 + k
    const __m512d x = _mm512_castps_pd(c[2 * u]), y = _mm512_castps_pd(c[2 * u + 1]);
    d[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // l^1: block k holds vectors k, 4 + k, 8 + k, 12 + k; put back in order
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// The scores of 16 columns from j (count of them real): the mask's, -inf where hidden or past count.
inline __mmask16 real(int64_t count) { return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }
inline __m512 masked(const Causal& m, int64_t j, int64_t count, __m512 x) {
  const int64_t seen = std::clamp<int64_t>(m.last - j + 1, 0, 16);
  return _mm512_mask_blend_ps(real(std::min(count, seen)), _mm512_set1_ps(NEG_INF), x);
}
inline __m512 masked(const Boolean& m, int64_t j, int64_t count, __m512 x) {
  const __m128i bytes = _mm_maskz_loadu_epi8(real(count), m.row + j);
  return _mm512_mask_blend_ps(_mm_test_epi8_mask(bytes, bytes), _mm512_set1_ps(NEG_INF), x);
}
inline __m512 masked(const Added& m, int64_t j, int64_t count, __m512 x) {
  const __m512 add = load(m.row + j, count);
  const __mmask16 sees = _mm512_cmp_ps_mask(add, _mm512_set1_ps(static_cast<float>(std::numeric_limits<T>::lowest())), _CMP_GT_OQ);
  return _mm512_mask_blend_ps(sees & real(count), _mm512_set1_ps(NEG_INF), _mm512_add_ps(x, add));
}

template <int64_t NV, int64_t QB>
void weigh_rows(T* const* out, int64_t rows, const T* v, int64_t width, int64_t v_col, float* s, int64_t s_row);

// Rows of one KV head's queries (up to QB) at once, sharing each key and value column; head dimensions of ND and
// NV whole vectors. A row's arithmetic does not depend on the others in the block or on where its columns fall.
template <int64_t ND, int64_t NV, int64_t QB, typename Sees>
void attend_rows(const T* const* q, T* const* out, const Sees* sees, int64_t rows, const T* k, const T* v,
                 int64_t width, int64_t k_col, int64_t v_col, float scale, float* s, int64_t s_row, float* kf) {
  constexpr int64_t D = ND * L;
  Vec qv[QB][ND];
  for (int64_t r = 0; r < QB; ++r)
    for (int64_t c = 0; c < ND; ++c) qv[r][c] = r < rows ? load(q[r] + c * L, L) : Vec(0.f);
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t count = std::min<int64_t>(16, width - j);
    for (int64_t x = 0; x < 16; ++x) {  // keys to fp32 (past count: the last column again, its score dropped)
      const T* kc = k + (j + std::min(x, count - 1)) * k_col;
      for (int64_t c = 0; c < ND; ++c) load(kc + c * L, L).store(kf + x * D + c * L);
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < QB; ++r) {
      if (r >= rows) break;
      __m512 dots[16];
#pragma GCC unroll 16
      for (int64_t x = 0; x < 16; ++x) {
        Vec dot(0.f);
        for (int64_t c = 0; c < ND; ++c) dot = at::vec::fmadd(qv[r][c], Vec::loadu(kf + x * D + c * L), dot);
        dots[x] = dot;
      }
      const __m512 x = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
      _mm512_storeu_ps(s + r * s_row + j, masked(sees[r], j, count, x));
    }
  }
  weigh_rows<NV, QB>(out, rows, v, width, v_col, s, s_row);
}

// The softmax of up to QB rows of scores (s, masked: -inf where hidden, stored 16 columns at a time) and their values'
// sums over the columns in order, one column at a time, a column no row weighs skipped.
template <int64_t NV, int64_t QB>
void weigh_rows(T* const* out, int64_t rows, const T* v, int64_t width, int64_t v_col, float* s, int64_t s_row) {
  float top[QB], total[QB];
#pragma GCC unroll 4
  for (int64_t r = 0; r < QB; ++r) {
    total[r] = 0.f;
    top[r] = NEG_INF;
    if (r >= rows) continue;
    float* sr = s + r * s_row;
    // the row was stored 16 columns at a time, -inf past the last: whole vectors
    Vec m(NEG_INF);
    for (int64_t j = 0; j < width; j += L) m = at::vec::maximum(m, Vec::loadu(sr + j));
    top[r] = _mm512_reduce_max_ps(m);
    if (top[r] == NEG_INF) continue;
    for (int64_t j = 0; j < width; j += L) (Vec::loadu(sr + j) - Vec(top[r])).exp().store(sr + j);
  }
  // Rows past `rows` or seeing nothing: no weight anywhere. A column no row weighs is skipped; one that some row
  // weighs was written (values finite), so the rows with no weight on it add exact zeros.
#pragma GCC unroll 4
  for (int64_t r = 0; r < QB; ++r)
    if (r >= rows || top[r] == NEG_INF) std::fill(s + r * s_row, s + r * s_row + width, 0.f);
  __m512 acc[QB * NV];
#pragma GCC unroll 32
  for (int64_t i = 0; i < QB * NV; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; ++j) {
    float e[QB];
    bool any = false;
#pragma GCC unroll 4
    for (int64_t r = 0; r < QB; ++r) {
      e[r] = s[r * s_row + j];
      any |= e[r] != 0.f;
    }
    if (!any) continue;
    const T* vc = v + j * v_col;
    __m512 vv[NV];
#pragma GCC unroll 8
    for (int64_t c = 0; c < NV; ++c) vv[c] = load(vc + c * L, L);
#pragma GCC unroll 32
    for (int64_t i = 0; i < QB * NV; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(e[i / NV]), vv[i % NV], acc[i]);
#pragma GCC unroll 4
    for (int64_t r = 0; r < QB; ++r) total[r] += e[r];
  }
  // (loops over the rows run to QB, unrolled: the accumulators stay in registers only if always indexed by constants)
#pragma GCC unroll 4
  for (int64_t r = 0; r < QB; ++r) {
    if (r >= rows) break;
    const __m512 inv = _mm512_set1_ps(total[r]);
#pragma GCC unroll 8
    for (int64_t c = 0; c < NV; ++c)
      store(out[r] + c * L, top[r] == NEG_INF ? Vec(0.f) : Vec(_mm512_div_ps(acc[r * NV + c], inv)), L);
  }
}

#ifdef ATTENTION_AMX
// Up to 16 rows of one KV head's queries (bf16): the scores on AMX's tiles (`amx_scores`), scaled and masked as
// attend_rows's, then weigh_rows four rows at a time.
template <int64_t NV, typename Sees>
void attend_amx(const T* const* q, T* const* out, const Sees* sees, int64_t rows, const T* k, const T* v,
                int64_t width, int64_t d, int64_t k_col, int64_t v_col, float scale, float* s, int64_t s_row) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    using B = const at::BFloat16;  // (T is bf16 here; the casts only let the fp32 kernel's copy compile)
    if (d == 64)
      flashdraft_attention::amx_scores<2>(reinterpret_cast<B* const*>(q), rows, reinterpret_cast<B*>(k), width, k_col,
                                          s, s_row);
    else  // 128
      flashdraft_attention::amx_scores<4>(reinterpret_cast<B* const*>(q), rows, reinterpret_cast<B*>(k), width, k_col,
                                          s, s_row);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < width; j += 16) {
        float* sr = s + r * s_row + j;
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr), _mm512_set1_ps(scale));
        _mm512_storeu_ps(sr, masked(sees[r], j, std::min<int64_t>(16, width - j), x));
      }
    for (int64_t r = 0; r < rows; r += 4)
      weigh_rows<NV, 4>(out + r, std::min<int64_t>(4, rows - r), v, width, v_col, s + r * s_row, s_row);
  }
}
#endif
#endif
}  // namespace

// query [b, heads, n, d], key [b, kv_heads, >= width, d], value [b, kv_heads, >= width, dv] (strides given, the
// last one 1); mask [b, 1 | heads, n, width] (strides given, 0 where broadcast; the last one 1) or none (causal);
// out [b, n, heads, dv] contiguous. A KV head's query rows are (query, head of the group) in that order; the work is
// split into blocks of a KV head's rows.
void kernel(const T* q, const T* k, const T* v, const void* mask, T* out, int64_t batch, int64_t heads,
            int64_t kv_heads, int64_t n, int64_t width, int64_t d, int64_t dv, int64_t q_row,
            int64_t q_head, int64_t q_tok, int64_t k_row, int64_t k_head, int64_t k_col, int64_t v_row,
            int64_t v_head, int64_t v_col, int64_t mask_kind, int64_t m_row, int64_t m_head,
            int64_t m_tok, float scale) {
  constexpr int64_t MAX_QB = 16;
  const int64_t groups = heads / kv_heads, rows = n * groups;
#if defined(CPU_CAPABILITY_AVX512)
  const bool fast64 = d == 64 && dv == 64, fast128 = d == 128 && dv == 128;
#else
  const bool fast64 = false, fast128 = false;
#endif
#if defined(ATTENTION_AMX)
  const bool tiles = std::is_same_v<T, at::BFloat16> && flashdraft_attention::amx && (fast64 || fast128);
#else
  constexpr bool tiles = false;
#endif
  // rows per block: as many as the registers (or a tile) hold, fewer where that leaves a thread without work
  int64_t qb = tiles ? 16 : fast64 ? 4 : fast128 ? 2 : 1;
  const int64_t threads = omp_get_max_threads();
  while (qb > 1 && batch * kv_heads * ((rows + qb - 1) / qb) < 2 * threads) qb /= 2;
  const int64_t blocks = (rows + qb - 1) / qb, units = batch * kv_heads * blocks;
  const int64_t padded = ((std::max(d, dv) + L - 1) / L) * L, s_row = width + L;
  const bool parallel = units > 1 && batch * kv_heads * rows * width * (d + dv) >= 65536;
#pragma omp parallel if (parallel)
  {
    std::vector<float> qf(padded, 0.f), acc(padded, 0.f), kf(16 * 128);
    thread_local std::vector<float> s;  // the scores of a block's rows (kept: 16 rows of a long width run past 128 KiB)
    if (static_cast<int64_t>(s.size()) < MAX_QB * s_row) s.resize(MAX_QB * s_row);
#if defined(ATTENTION_AMX)
    if (tiles) flashdraft_attention::configure_tiles();
#endif
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t blk = u % blocks, kh = (u / blocks) % kv_heads, r = u / (blocks * kv_heads);
      const T* kr = k + r * k_row + kh * k_head;
      const T* vr = v + r * v_row + kh * v_head;
      const int64_t first = blk * qb, count = std::min(qb, rows - first);
      const T* qs[MAX_QB];
      T* os[MAX_QB];
      int64_t m_at[MAX_QB];
      for (int64_t x = 0; x < count; ++x) {
        const int64_t i = (first + x) / groups, h = kh * groups + (first + x) % groups;
        qs[x] = q + r * q_row + h * q_head + i * q_tok;
        os[x] = out + ((r * n + i) * heads + h) * dv;
        m_at[x] = r * m_row + h * m_head + i * m_tok;
      }
      auto run = [&](auto make) {
        using Sees = decltype(make(0));
        Sees sees[MAX_QB];
        for (int64_t x = 0; x < count; ++x) sees[x] = make(x);
#if defined(ATTENTION_AMX)
        if (tiles && fast64) attend_amx<4>(qs, os, sees, count, kr, vr, width, d, k_col, v_col, scale, s.data(), s_row);
        else if (tiles) attend_amx<8>(qs, os, sees, count, kr, vr, width, d, k_col, v_col, scale, s.data(), s_row);
        else
#endif
#if defined(CPU_CAPABILITY_AVX512)
        if (fast64 && qb == 4) attend_rows<4, 4, 4>(qs, os, sees, count, kr, vr, width, k_col, v_col, scale, s.data(), s_row, kf.data());
        else if (fast64 && qb == 2) attend_rows<4, 4, 2>(qs, os, sees, count, kr, vr, width, k_col, v_col, scale, s.data(), s_row, kf.data());
        else if (fast64) attend_rows<4, 4, 1>(qs, os, sees, count, kr, vr, width, k_col, v_col, scale, s.data(), s_row, kf.data());
        else if (fast128 && qb == 2) attend_rows<8, 8, 2>(qs, os, sees, count, kr, vr, width, k_col, v_col, scale, s.data(), s_row, kf.data());
        else if (fast128) attend_rows<8, 8, 1>(qs, os, sees, count, kr, vr, width, k_col, v_col, scale, s.data(), s_row, kf.data());
        else
#endif
        attend_row(qs[0], kr, vr, os[0], sees[0], width, d, dv, k_col, v_col, scale, qf.data(), s.data(), acc.data());
      };
      const int64_t last = width - n;
      if (mask_kind == 1) run([&](int64_t x) { return Boolean{static_cast<const bool*>(mask) + m_at[x]}; });
      else if (mask_kind == 2) run([&](int64_t x) { return Added{static_cast<const T*>(mask) + m_at[x]}; });
      else run([&](int64_t x) { return Causal{last + (first + x) / groups}; });
    }
#if defined(ATTENTION_AMX)
    if (tiles) _tile_release();
#endif
  }
}
// ==== flashdraft: the operator ====

namespace {
// query [b, heads, n, d], key/value [b, kv_heads, >= width, d | dv], mask [b | 1, 1 | heads, n | 1, width] bool or
// added (the query's dtype) or none (causal), the last dims contiguous -> [b, n, heads, dv]
at::Tensor short_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& mask, double scale) {
  constexpr const char* op = "flashdraft::short_attention: ";
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op, "query, key and value must be 4-D");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), op,
              "query, key and value must share a dtype");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, op,
              "the last dims must be contiguous");
  const int64_t b = query.size(0), heads = query.size(1), n = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), dv = value.size(3);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && key.size(3) == d, op, "the key's heads do not fit the query's");
  TORCH_CHECK(key.size(0) == b && value.size(0) == b && value.size(1) == kv_heads, op,
              "the value's rows or heads do not fit the key's");
  at::Tensor out = at::empty({b, n, heads, dv}, query.options());
  int64_t width = key.size(2), kind = @NONE@, m_row = 0, m_head = 0, m_tok = 0;
  const void* m = query.data_ptr();
  if (mask.has_value()) {
    const at::Tensor& t = *mask;
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, op, "the mask must be 4-D, its last dim contiguous");
    kind = t.scalar_type() == at::kBool ? @BOOL@ : @ADDED@;
    TORCH_CHECK(kind == @BOOL@ || t.scalar_type() == query.scalar_type(), op, "an added mask must have the query's dtype");
    width = t.size(3);
    TORCH_CHECK(width <= key.size(2), op, "the mask is wider than the keys");
    TORCH_CHECK((t.size(0) == 1 || t.size(0) == b) && (t.size(1) == 1 || t.size(1) == heads) &&
                    (t.size(2) == 1 || t.size(2) == n),
                op, "the mask's rows, heads or queries do not fit the query's");
    m_row = t.size(0) == 1 ? 0 : t.stride(0);  // a broadcast dimension's index stays 0
    m_head = t.size(1) == 1 ? 0 : t.stride(1);
    m_tok = t.size(2) == 1 ? 0 : t.stride(2);
    m = t.data_ptr();
  }
  TORCH_CHECK(value.size(2) >= width, op, "the value has fewer columns than the mask or the keys");
#define FLASHDRAFT_ATTEND(NS, C)                                                                                  \
  NS::kernel(query.data_ptr<C>(), key.data_ptr<C>(), value.data_ptr<C>(), m, out.data_ptr<C>(), b, heads,       \
             kv_heads, n, width, d, dv, query.stride(0), query.stride(1), query.stride(2), key.stride(0),         \
             key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), kind, m_row, m_head, \
             m_tok, static_cast<float>(scale))
  switch (query.scalar_type()) {
    case at::kBFloat16: FLASHDRAFT_ATTEND(k_bfloat16, at::BFloat16); break;
    case at::kFloat: FLASHDRAFT_ATTEND(k_float32, float); break;
    default: TORCH_CHECK(false, op, "no kernel for ", query.scalar_type());
  }
#undef FLASHDRAFT_ATTEND
  return out;
}
}  // namespace

TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("short_attention", &short_attention); }
