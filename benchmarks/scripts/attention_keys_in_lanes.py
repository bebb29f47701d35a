"""cpu_attention's kernel against a variant with the keys in vector lanes: each 16-column tile of keys transposed
once per block of up to 16 query rows (a column in each fp32 lane), a row's 16 scores as `vdpbf16ps` over the head
dimension's pairs (no sum across lanes); softmax and values as the kernel's. Checks the variant as the kernel's tests
do (a row's bits alone and beside others, the error against fp32 SDPA), then times both on SmolLM2-135M's shapes
(9 query heads over 3 KV heads of 64, a causal bool mask), interleaved, 2 threads (T=1: one). `probe`: the CPU's
`vdpbf16ps` and FMA rates (gcc). benchmarks/README.md, 2026-12-05 (stop 73): not landed.
Run: python benchmarks/scripts/attention_keys_in_lanes.py [probe]"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._inductor.codecache import CppCodeCache

import flashdraft.kernels.attention_cpp as CA

torch.set_num_threads(int(os.environ.get("T", "2")))

VARIANT = r"""
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// 16 vectors of 16 32-bit elements transposed in place: element e of vector x goes to element x of vector e.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // in each 128-bit block L: element 4L + e of vectors 4i..4i+3 in u[4i + e]
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // the 4 x 4 transpose of 128-bit blocks among u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i a0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), a1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
    const __m512i b0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), b1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[8 + e] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    t[4 + e] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
  for (int x = 0; x < 16; ++x) r[x] = t[x];
}


// The scores of R rows over 16 columns whose keys kt holds transposed (pair p of dims h * 32 + 2p, +1 of column x in
// lane x of kt[h * 16 + p]): each row's NP accumulators sum their pairs in order, then each other in order.
template <int64_t NP, int64_t R, typename Sees>
inline void scores_rows(const at::BFloat16* const* q, const Sees* sees, const __m512i* kt, float* s, int64_t s_row,
                        int64_t j, int64_t count, __m512 scale_v) {
  const int32_t* qp[R];
#pragma GCC unroll 4
  for (int64_t x = 0; x < R; ++x) qp[x] = reinterpret_cast<const int32_t*>(q[x]);
  __m512 acc[R * NP];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R * NP; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < 16; ++p) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < R * NP; ++i) {
      const int64_t x = i / NP, h = i % NP;
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(qp[x][h * 16 + p]), (__m512bh)kt[h * 16 + p]);
    }
  }
#pragma GCC unroll 4
  for (int64_t x = 0; x < R; ++x) {
    __m512 dot = acc[x * NP];
#pragma GCC unroll 4
    for (int64_t h = 1; h < NP; ++h) dot = _mm512_add_ps(dot, acc[x * NP + h]);
    _mm512_storeu_ps(s + x * s_row + j, masked(sees[x], j, count, _mm512_mul_ps(dot, scale_v)));
  }
}

// bf16 rows of one KV head's queries (up to 16) with avx512_bf16: 16 columns' keys transposed once, a column in each
// fp32 lane, so a row's 16 scores are NP * 16 `vdpbf16ps` (two products each) with no sum across lanes. A score sums
// its head dimension's pairs (2p, 2p + 1) in order, p < 16 in one accumulator and each further 16 in another, then
// the accumulators in order: its bits depend on nothing but its query and key. Softmax and values as attend_rows.
template <int64_t NP, int64_t NV, int64_t G, typename Sees>
void attend_pairs(const at::BFloat16* const* q, at::BFloat16* const* out, const Sees* sees, int64_t rows,
                  const at::BFloat16* k, const at::BFloat16* v, int64_t width, int64_t k_col, int64_t v_col,
                  float scale, float* s, int64_t s_row, __m512i* kt) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t count = std::min<int64_t>(16, width - j);
    for (int64_t h = 0; h < NP; ++h) {  // past count: the last column again, its score dropped
      for (int64_t x = 0; x < 16; ++x)
        kt[h * 16 + x] = _mm512_loadu_si512(k + (j + std::min(x, count - 1)) * k_col + h * 32);
      transpose16(kt + h * 16);
    }
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) scores_rows<NP, 4>(q + r0, sees + r0, kt, s + r0 * s_row, s_row, j, count, scale_v);
    switch (rows - r0) {
      case 1: scores_rows<NP, 1>(q + r0, sees + r0, kt, s + r0 * s_row, s_row, j, count, scale_v); break;
      case 2: scores_rows<NP, 2>(q + r0, sees + r0, kt, s + r0 * s_row, s_row, j, count, scale_v); break;
      case 3: scores_rows<NP, 3>(q + r0, sees + r0, kt, s + r0 * s_row, s_row, j, count, scale_v); break;
      default: break;
    }
  }
  float top[16], total[16];
  for (int64_t r = 0; r < rows; ++r) {
    total[r] = 0.f;
    float* sr = s + r * s_row;
    Vec m(NEG_INF);
    for (int64_t j = 0; j < width; j += L) m = at::vec::maximum(m, Vec::loadu(sr + j));
    top[r] = _mm512_reduce_max_ps(m);
    if (top[r] == NEG_INF) std::fill(sr, sr + width, 0.f);
    else for (int64_t j = 0; j < width; j += L) (Vec::loadu(sr + j) - Vec(top[r])).exp().store(sr + j);
  }
  for (int64_t g = 0; g < rows; g += G) {
    const int64_t here = std::min<int64_t>(G, rows - g);
    const float* sg = s + g * s_row;
    __m512 acc[G * NV];
#pragma GCC unroll 32
    for (int64_t i = 0; i < G * NV; ++i) acc[i] = _mm512_setzero_ps();
    float tot[G];
#pragma GCC unroll 4
    for (int64_t r = 0; r < G; ++r) tot[r] = 0.f;
    for (int64_t j = 0; j < width; ++j) {
      float e[G];
      bool any = false;
#pragma GCC unroll 4
      for (int64_t r = 0; r < G; ++r) {
        e[r] = r < here ? sg[r * s_row + j] : 0.f;
        any |= e[r] != 0.f;
      }
      if (!any) continue;
      const at::BFloat16* vc = v + j * v_col;
      __m512 vv[NV];
#pragma GCC unroll 8
      for (int64_t c = 0; c < NV; ++c) vv[c] = load(vc + c * L, L);
#pragma GCC unroll 32
      for (int64_t i = 0; i < G * NV; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(e[i / NV]), vv[i % NV], acc[i]);
#pragma GCC unroll 4
      for (int64_t r = 0; r < G; ++r) tot[r] += e[r];
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < G; ++r) {
      if (r >= here) break;
      const __m512 inv = _mm512_set1_ps(tot[r]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < NV; ++c)
        store(out[g + r] + c * L, top[g + r] == NEG_INF ? Vec(0.f) : Vec(_mm512_div_ps(acc[r * NV + c], inv)), L);
    }
  }
}
#endif
"""

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main() {
  __m512 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.f);
  __m512i x = _mm512_set1_epi32(0x3f803f80), y = _mm512_set1_epi32(0x00010001);
  const long N = 50000000;
  double t = now();
  for (long n = 0; n < N; ++n) {
#define D(i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)x, (__m512bh)y);
    D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11)
    __asm__ volatile("" : "+v"(x));
  }
  const double dp = 12.0 * N / (now() - t) / 1e9;
  t = now();
  for (long n = 0; n < N; ++n) {
#define F(i) a[i] = _mm512_fmadd_ps(a[i], (__m512)x, (__m512)y);
    F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
    __asm__ volatile("" : "+v"(x));
  }
  const double fma = 12.0 * N / (now() - t) / 1e9;
  float s = 0; for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(a[i]);
  printf("one core, 12 independent chains: vdpbf16ps %.2f G/s (%.1f G products/s), vfmadd231ps %.2f G/s "
         "(%.1f G products/s) [%g]\n", dp, 32 * dp, fma, 16 * fma, s);
}
"""


def variant_source() -> str:
    kernel = CA.parts()[1]
    k = kernel.replace("#endif\n}  // namespace\n", "#endif\n" + VARIANT + "}  // namespace\n", 1)
    k = k.replace("constexpr int64_t MAX_QB = 4;", "constexpr int64_t MAX_QB = 16;")
    k = k.replace(
        "int64_t qb = fast64 ? 4 : fast128 ? 2 : 1;",
        "#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)\n"
        "  const bool pairs = std::is_same_v<T, at::BFloat16> && (fast64 || fast128);\n#else\n"
        "  const bool pairs = false;\n#endif\n"
        "  int64_t qb = pairs ? 16 : fast64 ? 4 : fast128 ? 2 : 1;\n  const int64_t least = pairs ? 4 : 1;",
    )
    k = k.replace("while (qb > 1 && batch", "while (qb > least && batch")
    k = k.replace("s(MAX_QB * s_row)", "s(qb * s_row)")
    old = "        if (fast64 && qb == 4) attend_rows"
    assert old in k
    k = k.replace(
        old,
        "#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)\n"
        "        if constexpr (std::is_same_v<T, at::BFloat16>) {\n"
        "          alignas(64) __m512i kt[64];\n"
        "          if (pairs && fast64) { attend_pairs<2, 4, 4>(qs, os, sees, count, kr, vr, width, k_col, v_col, "
        "scale, s.data(), s_row, kt); return; }\n"
        "          if (pairs && fast128) { attend_pairs<4, 8, 2>(qs, os, sees, count, kr, vr, width, k_col, v_col, "
        "scale, s.data(), s_row, kt); return; }\n"
        "        }\n#endif\n" + old,
        1,
    )
    return CA.source().replace(kernel, k)


_lib = torch.library.Library("fdx", "DEF")
_kept = []


def build(name: str, src: str):
    """The library under its own operator and namespaces (two loaded libraries share no symbol)."""
    src = src.replace("k_bfloat16", f"k_bfloat16_{name}").replace("k_float32", f"k_float32_{name}")
    src = src.replace(
        'TORCH_LIBRARY_IMPL(flashdraft, CPU, m) { m.impl("short_attention"',
        f'TORCH_LIBRARY_IMPL(fdx, CPU, m) {{ m.impl("{name}"',
    )
    _lib.define(f"{name}(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")

    class Cache(CppCodeCache):
        cache: dict = {}
        cache_clear = staticmethod(cache.clear)
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    _kept.append(Cache.load(src, device_type="cpu", needs_vec_isa=True))
    return getattr(torch.ops.fdx, name)


def inputs(n: int, width: int, capacity: int = 2048):
    q = torch.randn(1, 9, n, 64).bfloat16()
    k, v = torch.randn(1, 3, capacity, 64).bfloat16(), torch.randn(1, 3, capacity, 64).bfloat16()
    mask = torch.zeros(1, 1, n, width, dtype=torch.bool)
    for i in range(n):
        mask[0, 0, i, : width - n + i + 1] = True
    return q, k, v, mask


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "p.c").write_text(PROBE)
            subprocess.run(
                ["gcc", "-O2", "-mavx512f", "-mavx512bf16", "-o", f"{d}/p", f"{d}/p.c"], check=True
            )
            subprocess.run([f"{d}/p"], check=True)
        sys.exit()
    ops = {"kernel": build("kernel", CA.source()), "keys_in_lanes": build("keys_in_lanes", variant_source())}
    torch.manual_seed(0)
    for name, op in ops.items():
        q, k, v, mask = inputs(16, 300)
        together = op(q, k, v, mask, 0.125)
        alone = all(
            torch.equal(
                op(q[:, :, i : i + 1].contiguous(), k, v, mask[:, :, i : i + 1].contiguous(), 0.125)[:, 0],
                together[:, i],
            )
            for i in range(16)
        )
        keys, values = (t[:, :, :300].float().repeat_interleave(3, 1) for t in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask)
        err = (together.float() - want.transpose(1, 2)).abs().max().item()
        print(
            f"{name}: a row's bits alone = beside 15 others: {alone}; max error against fp32 SDPA {err:.2e}"
        )
    for width in (300, 1000):
        for n in (1, 4, 8, 16):
            q, k, v, mask = inputs(n, width)
            best = {}
            for _ in range(3):  # rounds, the two in turn
                for name, op in ops.items():
                    for _ in range(20):
                        op(q, k, v, mask, 0.125)
                    times = []
                    for _ in range(200):
                        t0 = time.perf_counter()
                        op(q, k, v, mask, 0.125)
                        times.append(time.perf_counter() - t0)
                    best[name] = min(best.get(name, 1.0), statistics.median(times))
            print(
                f"{n:2d} queries over {width:4d} columns: "
                + ", ".join(f"{name} {1e6 * s:.1f} us" for name, s in best.items())
            )
