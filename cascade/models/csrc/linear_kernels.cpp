// Weight-only linear kernels for the few rows (1-32 tokens) decoding and verification multiply:
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x in fp32, W stored in fp16, int8 (per output channel)
// or int4 (per group of K), arithmetic in fp32.
//
// Why hand-written: torch ships no CPU kernel that streams a 16-bit (or lower) weight once per
// call for 2-32 rows. FBGEMM's fp16-weight GEMM (torch.ops.quantized.linear_dynamic_fp16) costs
// more with every row even when the weight sits in cache, oneDNN and MKL want fp32 weights
// (twice the bytes), bf16 rounds the activations, and torch.compile folds an fp32 weight and
// calls MKL (measured in docs/backends.md). Here each weight tile is loaded and converted once
// per call and multiplied into every row while it is in registers.
//
// Layout (packed in Python, cascade/models/native.py): the N output columns are cut into
// panels of NC = 32; a panel stores its K x 32 weights k-major, so a panel is one sequential
// stream of memory ([P, K, 32] fp16 / int8; int4: [P, K, 16] bytes, byte j of a row holding
// column j in its low nibble and column j + 16 in its high nibble, with [P, K / G, 32] scales).
// Two threads (OpenMP, torch's runtime) split the panels; one to three rows run up to four
// panels side by side (more independent accumulators, the same order per output element).
//
// Row invariance: every output element is y[m, n] = fma(x[m, K-1], w[K-1, n], ... fma(x[m, 0],
// w[0, n], 0)) (+ bias[n]) in exactly this order (int8: times the channel's scale before the
// bias; int4: per group, then scaled), whatever the row count, the row block the row falls in
// and the other rows. So row i of an M-row call is bitwise the 1-row call on row i: a
// verification forward reproduces the autoregressive step's products bit for bit.
//
// Error bound (fp16 weights): the sequential fp32 sum of K products has
// |y - x.w| <= gamma_K * sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24 (the weights
// themselves are exact: fp16 holds every value it is given, checked at load).

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int NC = 32;  // columns per panel

// Software prefetch distance along a panel's stream. A weight stream read at the memory's rate
// with the FMAs of several rows per cache line leaves the core no slack to wait for a line: the
// hardware prefetcher alone and a 1 KB lead left an 8-row pass over the 1.5B's layers at 1.28x
// the 1-row one on an EPYC with two 512-bit FMA pipes; 8 KB ahead (128 cache lines) lets the
// reads overlap the arithmetic: 0.98x (experiments/linear_rows.py; docs/backends.md, "Prefetch
// and row blocks").
#ifndef CASCADE_PREFETCH_BYTES
#define CASCADE_PREFETCH_BYTES 8192
#endif
constexpr int64_t PREFETCH_BYTES = CASCADE_PREFETCH_BYTES;  // -D override: experiments/linear_rows.py
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
}

// The int4 kernels' second stream: a group's 32 fp32 scales (two cache lines) per panel, read once
// per G k, prefetched as far ahead, in groups, as the weights are (the 0.5B's int4 x int8 layers
// at one row: 1.04-1.05x faster than without, experiments/linear_revision.py,
// results/kernels/linear_revision_scale_prefetch.log).
inline void prefetch_scales(const float* group_scales, int64_t G) {
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / (G * NC / 2)) * NC;  // floats
  _mm_prefetch(reinterpret_cast<const char*>(group_scales + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(group_scales + ahead + NC / 2), _MM_HINT_T0);
}

// ---- AVX-512 ---------------------------------------------------------------------------------

// The valid lanes of a panel's two 16-column halves when only ncols of its 32 columns exist.
struct PanelMasks {
  __mmask16 low, high;
};

__attribute__((target("avx512f"))) inline PanelMasks panel_masks(int ncols) {
  return {ncols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << ncols) - 1),
          ncols >= 32 ? static_cast<__mmask16>(0xFFFF)
                      : ncols <= 16 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << (ncols - 16)) - 1)};
}

// One output row of a panel: (+ bias), then the valid lanes stored.
__attribute__((target("avx512f"))) inline void store_row(float* y, __m512 a0, __m512 a1, const float* bias, PanelMasks pm) {
  if (bias) {
    a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(pm.low, bias));
    a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(pm.high, bias + 16));
  }
  _mm512_mask_storeu_ps(y, pm.low, a0);
  _mm512_mask_storeu_ps(y + 16, pm.high, a1);
}

// PP panels (side by side in memory, pstride elements apart), MR rows: acc[q][m][0..1] hold
// columns 0-15 and 16-31 of panel q, row m. Each output element is still one sequential FMA chain
// over k; PP > 1 only gives one or two rows enough independent chains to hide the FMA latency
// (with 2 accumulators a 1-row pass waits on each FMA's result), so the result does not depend
// on PP. Only the last panel of a pass may be partial (ncols valid columns).
template <int MR, int PP>
__attribute__((target("avx512f"))) void fp16_rows_avx512(const float* x, int64_t ldx, const uint16_t* panel,
                                                          int64_t pstride, int64_t K, const float* bias, float* y,
                                                          int64_t ldy, int ncols) {
  __m512 acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[PP][2];
    for (int q = 0; q < PP; ++q) {
      const uint16_t* wk = panel + q * pstride + k * NC;
      prefetch_ahead(wk);
      w[q][0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk)));
      w[q][1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int q = 0; q < PP; ++q) {
        acc[q][m][0] = _mm512_fmadd_ps(xb, w[q][0], acc[q][m][0]);
        acc[q][m][1] = _mm512_fmadd_ps(xb, w[q][1], acc[q][m][1]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const PanelMasks pm = panel_masks(q == PP - 1 ? ncols : NC);
    for (int m = 0; m < MR; ++m) store_row(y + m * ldy + q * NC, acc[q][m][0], acc[q][m][1], bias ? bias + q * NC : nullptr, pm);
  }
}

// int8, one scale per output column: y = (sum_k x_k q_k) * scale (+ bias); PP panels as fp16's.
template <int MR, int PP>
__attribute__((target("avx512f"))) void int8_rows_avx512(const float* x, int64_t ldx, const int8_t* panel,
                                                          int64_t pstride, int64_t K, const float* scale,
                                                          const float* bias, float* y, int64_t ldy, int ncols) {
  __m512 acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[PP][2];
    for (int q = 0; q < PP; ++q) {
      const int8_t* wk = panel + q * pstride + k * NC;
      prefetch_ahead(wk);
      w[q][0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk))));
      w[q][1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16))));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int q = 0; q < PP; ++q) {
        acc[q][m][0] = _mm512_fmadd_ps(xb, w[q][0], acc[q][m][0]);
        acc[q][m][1] = _mm512_fmadd_ps(xb, w[q][1], acc[q][m][1]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const PanelMasks pm = panel_masks(q == PP - 1 ? ncols : NC);
    const float* sq = scale + q * NC;
    const __m512 s0 = _mm512_maskz_loadu_ps(pm.low, sq), s1 = _mm512_maskz_loadu_ps(pm.high, sq + 16);
    for (int m = 0; m < MR; ++m) {
      __m512 a0 = _mm512_mul_ps(acc[q][m][0], s0), a1 = _mm512_mul_ps(acc[q][m][1], s1);
      store_row(y + m * ldy + q * NC, a0, a1, bias ? bias + q * NC : nullptr, pm);
    }
  }
}

// int4, symmetric per (group of G k, column): w = (q - 8) * s. Per group the row's products
// with q are summed, then acc += s * (group sum - 8 * sum of x over the group) (xsum: [MR, K/G]).
// PP panels as fp16's (pstride bytes apart; their scales sstride floats apart).
template <int MR, int PP>
__attribute__((target("avx512f"))) void int4_rows_avx512(const float* x, int64_t ldx, const float* xsum,
                                                          int64_t ldxs, const uint8_t* panel, int64_t pstride,
                                                          int64_t K, int64_t G, const float* scales, int64_t sstride,
                                                          const float* bias, float* y, int64_t ldy, int ncols) {
  __m512 acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 gacc[PP][MR][2];
    for (int q = 0; q < PP; ++q)
      for (int m = 0; m < MR; ++m) gacc[q][m][0] = gacc[q][m][1] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      __m512 w[PP][2];
      for (int q = 0; q < PP; ++q) {
        const uint8_t* wk = panel + q * pstride + k * (NC / 2);
        prefetch_ahead(wk);
        const __m512i qv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk)));
        w[q][0] = _mm512_cvtepi32_ps(_mm512_and_si512(qv, low));
        w[q][1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(qv, 4));
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
        for (int q = 0; q < PP; ++q) {
          gacc[q][m][0] = _mm512_fmadd_ps(xb, w[q][0], gacc[q][m][0]);
          gacc[q][m][1] = _mm512_fmadd_ps(xb, w[q][1], gacc[q][m][1]);
        }
      }
    }
    for (int q = 0; q < PP; ++q) {
      const float* sg = scales + q * sstride + g * NC;
      prefetch_scales(sg, G);
      const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 off = _mm512_set1_ps(8.0f * xsum[m * ldxs + g]);
        acc[q][m][0] = _mm512_fmadd_ps(_mm512_sub_ps(gacc[q][m][0], off), s0, acc[q][m][0]);
        acc[q][m][1] = _mm512_fmadd_ps(_mm512_sub_ps(gacc[q][m][1], off), s1, acc[q][m][1]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const PanelMasks pm = panel_masks(q == PP - 1 ? ncols : NC);
    for (int m = 0; m < MR; ++m) store_row(y + m * ldy + q * NC, acc[q][m][0], acc[q][m][1], bias ? bias + q * NC : nullptr, pm);
  }
}

// ---- AVX2 + F16C + FMA -----------------------------------------------------------------------
// 16 ymm registers: a panel's 32 columns are 4 vectors of 8; rows are taken MR at a time with
// NV vectors (columns c0 .. c0 + 8 NV) of the panel per pass.

__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w_fp16(const uint16_t* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w_int8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// Store 8 lanes of a (columns c .. c+7 of the panel, ncols valid) through a stack buffer when partial.
__attribute__((target("avx2,fma,f16c"))) inline void store8(float* dst, __m256 a, int c, int ncols) {
  if (c + 8 <= ncols) {
    _mm256_storeu_ps(dst, a);
  } else if (c < ncols) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, a);
    std::memcpy(dst, tmp, sizeof(float) * (ncols - c));
  }
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* src, int c, int ncols) {
  if (c + 8 <= ncols) return _mm256_loadu_ps(src);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (c < ncols) std::memcpy(tmp, src, sizeof(float) * (ncols - c));
  return _mm256_load_ps(tmp);
}

// fp16 and int8: WT is the stored weight type; scale may be null (fp16).
template <int MR, int NV, typename WT>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const float* x, int64_t ldx, const WT* panel, int64_t K,
                                                         int c0, const float* scale, const float* bias, float* y,
                                                         int64_t ldy, int ncols) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const WT* w = panel + k * NC + c0;
    prefetch_ahead(w);
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) {
      if constexpr (sizeof(WT) == 2) wv[v] = load_w_fp16(reinterpret_cast<const uint16_t*>(w) + 8 * v);
      else wv[v] = load_w_int8(reinterpret_cast<const int8_t*>(w) + 8 * v);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(xb, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const int c = c0 + 8 * v;
      __m256 a = acc[m][v];
      if (scale) a = _mm256_mul_ps(a, load8(scale + c, c, ncols));
      if (bias) a = _mm256_add_ps(a, load8(bias + c, c, ncols));
      store8(y + m * ldy + c, a, c, ncols);
    }
}

// fp16 and int8 over PP whole panels side by side (pstride elements apart), MR rows: acc[q][m][v]
// holds columns 8v .. 8v + 7 of panel q, row m. For one or two rows this gives 8 independent FMA
// chains (an FMA's latency is ~4-5 cycles; one row over half a panel has only 2 chains, which
// leaves the kernel waiting on each FMA's result). Each output element is still one sequential
// FMA chain over k, so the result is bitwise rows_avx2's whatever MR, PP or the pass.
template <int MR, int PP, typename WT>
__attribute__((target("avx2,fma,f16c"))) void panels_avx2(const float* x, int64_t ldx, const WT* panel, int64_t pstride,
                                                           int64_t K, const float* scale, const float* bias, float* y,
                                                           int64_t ldy, int ncols) {
  __m256 acc[PP][MR][4];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) acc[q][m][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int q = 0; q < PP; ++q) {
      const WT* w = panel + q * pstride + k * NC;
      prefetch_ahead(w);
      __m256 wv[4];
      for (int v = 0; v < 4; ++v) {
        if constexpr (sizeof(WT) == 2) wv[v] = load_w_fp16(reinterpret_cast<const uint16_t*>(w) + 8 * v);
        else wv[v] = load_w_int8(reinterpret_cast<const int8_t*>(w) + 8 * v);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);
        for (int v = 0; v < 4; ++v) acc[q][m][v] = _mm256_fmadd_ps(xb, wv[v], acc[q][m][v]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const int nq = q == PP - 1 ? ncols : NC;
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) {
        const int c = 8 * v;
        __m256 a = acc[q][m][v];
        if (scale) a = _mm256_mul_ps(a, load8(scale + q * NC + c, c, nq));
        if (bias) a = _mm256_add_ps(a, load8(bias + q * NC + c, c, nq));
        store8(y + m * ldy + q * NC + c, a, c, nq);
      }
  }
}

// int4 on AVX2, symmetric per (group of G k, column) as int4_rows_avx512: a panel's byte j of
// row k holds column j (low nibble) and column 16 + j (high nibble). HALF = -1: whole panels
// (vectors 0-1 from the low nibbles of bytes 0-7 and 8-15, 2-3 from their high nibbles), PP
// panels side by side; HALF = 0 / 1: only columns 0-15 / 16-31 of one panel (PP = 1), so that
// up to 6 rows fit the registers. Per element the same sequence (a sequential FMA chain over the
// group's k, then acc += (group sum - 8 * xsum) * s) whatever the pass, MR or PP.
template <int MR, int PP, int HALF>
__attribute__((target("avx2,fma,f16c"))) void int4_rows_avx2(const float* x, int64_t ldx, const float* xsum,
                                                              int64_t ldxs, const uint8_t* panel, int64_t pstride,
                                                              int64_t K, int64_t G, const float* scales,
                                                              int64_t sstride, const float* bias, float* y,
                                                              int64_t ldy, int ncols) {
  constexpr int NV = HALF < 0 ? 4 : 2;  // vectors per panel in this pass
  constexpr int V0 = HALF == 1 ? 2 : 0;  // the first vector's index in the panel
  static_assert(HALF < 0 || PP == 1, "a half-panel pass covers one panel");
  __m256 acc[PP][MR][NV];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[q][m][v] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < K / G; ++g) {
    __m256 gacc[PP][MR][NV];
    for (int q = 0; q < PP; ++q)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) gacc[q][m][v] = _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; ++k) {
      for (int q = 0; q < PP; ++q) {
        const uint8_t* w = panel + q * pstride + k * (NC / 2);
        prefetch_ahead(w);
        const __m256i qa = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
        const __m256i qb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8)));
        __m256 wv[NV];
        if constexpr (HALF != 1) {
          wv[0] = _mm256_cvtepi32_ps(_mm256_and_si256(qa, low));
          wv[1] = _mm256_cvtepi32_ps(_mm256_and_si256(qb, low));
        }
        if constexpr (HALF < 0) {
          wv[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4));
          wv[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4));
        }
        if constexpr (HALF == 1) {
          wv[0] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4));
          wv[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4));
        }
        for (int m = 0; m < MR; ++m) {
          const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);
          for (int v = 0; v < NV; ++v) gacc[q][m][v] = _mm256_fmadd_ps(xb, wv[v], gacc[q][m][v]);
        }
      }
    }
    for (int q = 0; q < PP; ++q) {
      prefetch_scales(scales + q * sstride + g * NC, G);
      for (int m = 0; m < MR; ++m) {
        const __m256 off = _mm256_set1_ps(8.0f * xsum[m * ldxs + g]);
        for (int v = 0; v < NV; ++v) {
          const __m256 s = _mm256_loadu_ps(scales + q * sstride + g * NC + 8 * (V0 + v));
          acc[q][m][v] = _mm256_fmadd_ps(_mm256_sub_ps(gacc[q][m][v], off), s, acc[q][m][v]);
        }
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const int nq = q == PP - 1 ? ncols : NC;
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) {
        const int c = 8 * (V0 + v);
        __m256 a = acc[q][m][v];
        if (bias) a = _mm256_add_ps(a, load8(bias + q * NC + c, c, nq));
        store8(y + m * ldy + q * NC + c, a, c, nq);
      }
  }
}

// ---- dispatch --------------------------------------------------------------------------------

enum class Isa { none, avx2, avx512 };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return Isa::avx2;
  return Isa::none;
}

Isa isa() {
  static const Isa found = detect_isa();
  return found;
}

constexpr int MR512 = 8;  // rows per block on AVX-512 (16 accumulators)
// fp16 rows per block on AVX-512: 12 (24 accumulators + 2 weight vectors of the 32 registers),
// so a call of up to 12 rows streams each weight once from memory; more rows go in balanced
// blocks (13 -> 7 + 6) over one panel at a time, the later blocks reading it from L2.
#ifndef CASCADE_FP16_ROWS
#define CASCADE_FP16_ROWS 12
#endif
constexpr int MRF16 = CASCADE_FP16_ROWS;  // -D override: experiments/linear_rows.py

// fn(std::integral_constant<int, rows>) for a run-time rows in 1..Max: one template instance per
// row count (the register block's size is a compile-time constant)
template <int Max, typename Fn>
void with_rows(int rows, Fn&& fn) {
  if constexpr (Max > 1) {
    if (rows < Max) {
      with_rows<Max - 1>(rows, fn);
      return;
    }
  }
  fn(std::integral_constant<int, Max>{});
}

template <typename Fn>
void run_rows(int64_t M, int mr, Fn&& block) {  // block(r0, rows) for row blocks of <= mr rows
  for (int64_t r0 = 0; r0 < M; r0 += mr) block(r0, static_cast<int>(std::min<int64_t>(mr, M - r0)));
}

// Panels split between torch's intra-op threads (contiguous ranges: each thread streams its own
// part of the packed weight), a thread's range taken in groups of up to 4 panels: fn(p, count)
// for panels p .. p + count - 1 (the matrix's one partial panel, the last, ends its group).
template <typename Fn>
void for_panel_groups(int64_t P, Fn&& fn) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += 4) fn(p, static_cast<int>(std::min<int64_t>(4, p1 - p)));
  });
}

// A block of MR rows over `count` panels as passes of PP panels side by side: PP = 4 for one
// row, 2 for two or three, 1 from four, so a pass has >= 8 independent FMA chains (the latency
// of an FMA is ~4 cycles; one row over one panel has only 2 chains) within the 32 registers.
// pass(q, PP) covers panels q .. q + PP - 1 of the group.
template <int MR, typename Fn>
void panel_passes(int count, Fn&& pass) {
  constexpr int PP = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  int q = 0;
  for (; q + PP <= count; q += PP) pass(q, std::integral_constant<int, PP>{});
  for (; q < count; ++q) pass(q, std::integral_constant<int, 1>{});
}

// Valid columns of the last panel of a pass over panels p .. p + pp - 1.
inline int pass_ncols(int64_t N, int64_t p, int pp) { return static_cast<int>(std::min<int64_t>(NC, N - (p + pp - 1) * NC)); }

// Every tensor an op reads: on the CPU (the kernels dereference its data pointer), of the dtype
// the kernel reads, and laid out as the kernel walks it (contiguous; unit stride along the last
// dimension; or any strides, read through them).
enum class Layout { contiguous, unit_inner, strided };

void expect(const torch::Tensor& t, const char* op, const char* name, c10::ScalarType dtype, Layout layout) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is missing");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", c10::toString(dtype), ", got ", t.scalar_type());
  if (layout == Layout::contiguous) TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  if (layout == Layout::unit_inner)
    TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name, " needs unit stride along its last dimension");
}

void expect_bias(const c10::optional<torch::Tensor>& bias, const char* op, int64_t N) {
  if (!bias) return;
  expect(*bias, op, "bias", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(bias->numel() == N, op, ": bias must be [N] fp32");
}

void check_inputs(const char* op, const torch::Tensor& x, const torch::Tensor& packed, c10::ScalarType packed_dtype, int64_t N,
                  const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(isa() != Isa::none, "cascade native kernels need AVX2 + FMA + F16C or AVX-512");
  expect(x, op, "x", torch::kFloat32, Layout::unit_inner);
  expect(packed, op, "packed", packed_dtype, Layout::contiguous);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) * (packed.scalar_type() == torch::kUInt8 ? 2 : 1) == NC,
              op, ": packed weight must be [P, K, 32] (int4: [P, K, 16])");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has K = ", x.size(1), ", the weight ", packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * NC && N <= packed.size(0) * NC, "N = ", N, " does not match ", packed.size(0), " panels");
  expect_bias(bias, op, N);
}

// AVX2 passes over panels pg .. pg + count - 1 of an M-row call. Rows go in blocks of up to 6 as
// half-panel passes (2 vectors per row: 6-12 FMA chains) while 3 or more remain, each panel's
// half kept in cache across the row blocks; the last one or two rows go over whole panels (4
// vectors per row; one row takes two panels side by side), so a pass has >= 8 chains where the
// rows allow. half(p, c0, r0, rows) and whole(p, pp, r0, rows) run the kernels.
template <typename Half, typename Whole>
void avx2_passes(int64_t M, int64_t N, int64_t pg, int count, Half&& half, Whole&& whole) {
  const int64_t tail = M % 6 >= 3 ? 0 : M % 6;  // rows left for whole-panel passes
  const int64_t blocked = M - tail;
  if (blocked > 0)
    for (int64_t p = pg; p < pg + count; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(NC, N - p * NC));
      for (int c0 = 0; c0 < NC && c0 < ncols; c0 += 16)
        run_rows(blocked, 6, [&](int64_t r0, int rows) { half(p, c0, r0, rows); });
    }
  if (tail == 2) {
    for (int64_t p = pg; p < pg + count; ++p) whole(p, std::integral_constant<int, 1>{}, blocked, std::integral_constant<int, 2>{});
  } else if (tail == 1) {
    int q = 0;
    for (; q + 2 <= count; q += 2) whole(pg + q, std::integral_constant<int, 2>{}, blocked, std::integral_constant<int, 1>{});
    for (; q < count; ++q) whole(pg + q, std::integral_constant<int, 1>{}, blocked, std::integral_constant<int, 1>{});
  }
}

// fp16 / int8 (scale: null for fp16) through avx2_passes.
template <typename WT>
void linear_avx2(const float* xp, int64_t ldx, int64_t M, const WT* wp, int64_t K, const float* sp, const float* bp,
                 float* yp, int64_t N, int64_t pg, int count) {
  avx2_passes(
      M, N, pg, count,
      [&](int64_t p, int c0, int64_t r0, int rows) {
        const int ncols = static_cast<int>(std::min<int64_t>(NC, N - p * NC));
        with_rows<6>(rows, [&](auto r) {
          rows_avx2<decltype(r)::value, 2>(xp + r0 * ldx, ldx, wp + p * K * NC, K, c0, sp ? sp + p * NC : nullptr,
                                           bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, ncols);
        });
      },
      [&](int64_t p, auto pp, int64_t r0, auto rows) {
        constexpr int PP = decltype(pp)::value, MR = decltype(rows)::value;
        panels_avx2<MR, PP, WT>(xp + r0 * ldx, ldx, wp + p * K * NC, K * NC, K, sp ? sp + p * NC : nullptr,
                                bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, pass_ncols(N, p, PP));
      });
}

torch::Tensor linear_fp16(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& bias) {
  check_inputs("linear_fp16", x, packed, torch::kFloat16, N, bias);
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), ldx = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa which = isa();
  for_panel_groups(P, [&](int64_t pg, int count) {
    // One row: one panel's stream at a time (two FMA chains are enough for the memory's rate):
    // 1.00-1.02x on the 1.5B's layers (results/kernels/linear_revision_one_stream.log).
    if (which == Isa::avx512 && M == 1) {
      for (int64_t p = pg; p < pg + count; ++p)
        fp16_rows_avx512<1, 1>(xp, ldx, wp + p * K * NC, K * NC, K, bp ? bp + p * NC : nullptr, yp + p * NC, N,
                               pass_ncols(N, p, 1));
      return;
    }
    if (which == Isa::avx512 && M <= MRF16) {  // one block: each weight read once
      with_rows<MRF16>(static_cast<int>(M), [&](auto r) {
        constexpr int MR = decltype(r)::value;
        panel_passes<MR>(count, [&](int q, auto pp) {
          constexpr int PP = decltype(pp)::value;
          const int64_t p = pg + q;
          fp16_rows_avx512<MR, PP>(xp, ldx, wp + p * K * NC, K * NC, K, bp ? bp + p * NC : nullptr, yp + p * NC, N,
                                   pass_ncols(N, p, PP));
        });
      });
      return;
    }
    if (which == Isa::avx512) {  // balanced blocks of >= 7 rows, one panel at a time (the rest from L2)
      const int64_t blocks = (M + MRF16 - 1) / MRF16, mr = (M + blocks - 1) / blocks;
      for (int64_t p = pg; p < pg + count; ++p)
        run_rows(M, static_cast<int>(mr), [&](int64_t r0, int rows) {
          with_rows<MRF16>(rows, [&](auto r) {
            fp16_rows_avx512<decltype(r)::value, 1>(xp + r0 * ldx, ldx, wp + p * K * NC, K * NC, K,
                                                    bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N,
                                                    pass_ncols(N, p, 1));
          });
        });
      return;
    }
    linear_avx2(xp, ldx, M, wp, K, nullptr, bp, yp, N, pg, count);
  });
  return y;
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t N,
                          const c10::optional<torch::Tensor>& bias) {
  check_inputs("linear_int8", x, packed, torch::kInt8, N, bias);
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), ldx = x.stride(0);
  expect(scale, "linear_int8", "scale", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(scale.numel() == P * NC, "linear_int8: scale must be [P * 32] fp32 (padded)");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa which = isa();
  for_panel_groups(P, [&](int64_t pg, int count) {
    if (which == Isa::avx512) {
      run_rows(M, MR512, [&](int64_t r0, int rows) {
        with_rows<8>(rows, [&](auto r) {
          constexpr int MR = decltype(r)::value;
          panel_passes<MR>(count, [&](int q, auto pp) {
            constexpr int PP = decltype(pp)::value;
            const int64_t p = pg + q;
            int8_rows_avx512<MR, PP>(xp + r0 * ldx, ldx, wp + p * K * NC, K * NC, K, sp + p * NC,
                                     bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, pass_ncols(N, p, PP));
          });
        });
      });
      return;
    }
    linear_avx2(xp, ldx, M, wp, K, sp, bp, yp, N, pg, count);
  });
  return y;
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias) {
  check_inputs("linear_int4", x, packed, torch::kUInt8, N, bias);
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), ldx = x.stride(0);
  TORCH_CHECK(group > 0 && K % group == 0, "K = ", K, " is not a multiple of the group size ", group);
  expect(scales, "linear_int4", "scales", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(scales.dim() == 3 &&
                  scales.size(0) == P && scales.size(1) == K / group && scales.size(2) == NC,
              "scales must be [P, K / group, 32] fp32");
  const float* xp = x.data_ptr<float>();
  const int64_t ldxs = K / group;
  auto xsum = torch::empty({M, ldxs}, x.options());  // [M, K / G]: each row's sum over each group, in k order
  float* xs = xsum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ldxs; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xp[m * ldx + k];
      xs[m * ldxs + g] = s;
    }
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const Isa which = isa();
  const int64_t sstride = (K / group) * NC;
  for_panel_groups(P, [&](int64_t pg, int count) {
    if (which == Isa::avx512) {
      run_rows(M, 4, [&](int64_t r0, int rows) {
        with_rows<4>(rows, [&](auto r) {
          constexpr int MR = decltype(r)::value;
          panel_passes<MR>(count, [&](int q, auto pp) {
            constexpr int PP = decltype(pp)::value;
            const int64_t p = pg + q;
            int4_rows_avx512<MR, PP>(xp + r0 * ldx, ldx, xs + r0 * ldxs, ldxs, wp + p * K * (NC / 2), K * (NC / 2), K,
                                     group, sp + p * sstride, sstride, bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC,
                                     N, pass_ncols(N, p, PP));
          });
        });
      });
      return;
    }
    avx2_passes(
        M, N, pg, count,
        [&](int64_t p, int c0, int64_t r0, int rows) {
          const int ncols = static_cast<int>(std::min<int64_t>(NC, N - p * NC));
          const auto pass = [&](auto r, auto half) {
            int4_rows_avx2<decltype(r)::value, 1, decltype(half)::value>(
                xp + r0 * ldx, ldx, xs + r0 * ldxs, ldxs, wp + p * K * (NC / 2), K * (NC / 2), K, group,
                sp + p * sstride, sstride, bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, ncols);
          };
          with_rows<6>(rows, [&](auto r) {
            if (c0 == 0) pass(r, std::integral_constant<int, 0>{});
            else pass(r, std::integral_constant<int, 1>{});
          });
        },
        [&](int64_t p, auto pp, int64_t r0, auto rows) {
          constexpr int PP = decltype(pp)::value, MR = decltype(rows)::value;
          int4_rows_avx2<MR, PP, -1>(xp + r0 * ldx, ldx, xs + r0 * ldxs, ldxs, wp + p * K * (NC / 2), K * (NC / 2), K,
                                     group, sp + p * sstride, sstride, bp ? bp + p * NC : nullptr,
                                     yp + r0 * N + p * NC, N, pass_ncols(N, p, PP));
        });
  });
  return y;
}

// ---- attention over the cache, few queries --------------------------------------------------
// out[i, h] = sum_j softmax_j(scaling * q[h, i] . k[g, j] + mask[i, j]) v[g, j], g = h / (H / Hkv),
// over the keys j query i may see (mask above -FLT_MAX / 2; without a mask the causal limit
// j <= L - n + i).
// Row-invariant like the linears: each (query, head) is computed alone in one fixed order over
// the keys it may see, taken in order (keys it may not see are skipped, not weighted by zero), so
// its output depends only on q and those keys: not on how many other queries share the call, nor
// on where in the cache the visible keys lie (a tree node's path gives the same result as the
// same tokens decoded one by one).
// AVX-512 (attend_weights_avx512, weighted_values_avx512): the visible keys are numbered 0..V-1 in order and taken 16 at a time;
// key r's dot is an FMA chain over D in 16 lanes, then a fixed tree over the lanes
// (reduce16_avx512) that leaves it in lane r % 16 of the block's score vector; the softmax's max
// is exact; exp is vectorized (exp_avx512, Cephes' single-precision polynomial);
// its sum is kept per lane r % 16 and reduced by a fixed tree at the end; the weighted sum of
// values runs over r in order with D in registers. Every step is a function of the rank r and
// the values, so two calls that see the same keys in the same order agree bit for bit.
// AVX2: one key at a time (the dot over D in lanes then a sequential lane sum; the softmax and
// the weighted sum sequential over the keys).

__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
}

__attribute__((target("avx512f"))) void axpy_avx512(float p, const float* v, float* acc, int64_t D) {
  const __m512 pb = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pb, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1);
    _mm512_mask_storeu_ps(acc + d, m, _mm512_fmadd_ps(pb, _mm512_maskz_loadu_ps(m, v + d), _mm512_maskz_loadu_ps(m, acc + d)));
  }
}

__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (; d < D; ++d) lanes[d % 8] = std::fma(a[d], b[d], lanes[d % 8]);
  float s = 0.0f;
  for (int l = 0; l < 8; ++l) s += lanes[l];
  return s;
}

__attribute__((target("avx2,fma,f16c"))) void axpy_avx2(float p, const float* v, float* acc, int64_t D) {
  const __m256 pb = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
  for (; d < D; ++d) acc[d] = std::fma(p, v[d], acc[d]);
}

// Lane c of the result = the sum of v[c]'s 16 lanes, by the same tree for every c: within each
// 128-bit block (e0 + e2) + (e1 + e3), then the four blocks (b0 + b1) + (b2 + b3).
__attribute__((target("avx512f"))) inline __m512 reduce16_avx512(const __m512* v) {
  __m512 t[8], u[4];
  for (int c = 0; c < 8; ++c)
    t[c] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * c], v[2 * c + 1]), _mm512_unpackhi_ps(v[2 * c], v[2 * c + 1]));
  for (int c = 0; c < 4; ++c)  // block k of u[c]: the block-k sums of v[4c .. 4c + 3]
    u[c] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * c], t[2 * c + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * c], t[2 * c + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for x <= 0 (a score minus the row's max): Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2
// (ln2 in two parts), a degree-5 polynomial for (e^r - 1 - r) / r^2, then times 2^n (scalef
// rounds once, so results below the normal range come out as the nearest denormal or 0).
// Inputs are clamped at -104 (e^-104 is below the smallest denormal) so r stays small.
__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// One (query, head) over its V visible keys (key r at position pos[r] of the head's keys kb,
// rows ks floats apart; additive mask values add[r]): the softmax's numerators
// score[r] = e^(scale * q . k_r + add_r - max) (score: >= V rounded up to 16 floats) and their
// sum, returned. DC = the number of 16-lane chunks of D (<= 8); the last chunk has the lanes of
// `tail`.
template <int DC>
__attribute__((target("avx512f"))) float attend_weights_avx512(const float* qi, const float* kb, int64_t ks,
                                                                const int64_t* pos, const float* add, int64_t V,
                                                                float scale, __mmask16 tail, float* score) {
  __m512 qv[DC];
  for (int c = 0; c < DC; ++c) qv[c] = _mm512_maskz_loadu_ps(c == DC - 1 ? tail : 0xFFFF, qi + 16 * c);
  // 1. scores, 16 keys per block
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r0 = 0; r0 < V; r0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, V - r0));
    __m512 part[16];
    for (int c = 0; c < 16; ++c) {
      __m512 acc = _mm512_setzero_ps();
      if (c < count)
        for (int d = 0; d < DC; ++d)
          acc = _mm512_fmadd_ps(qv[d], _mm512_maskz_loadu_ps(d == DC - 1 ? tail : 0xFFFF, kb + pos[r0 + c] * ks + 16 * d), acc);
      part[c] = acc;
    }
    const __mmask16 valid = static_cast<__mmask16>(count == 16 ? 0xFFFF : (1u << count) - 1);
    const __m512 sv = _mm512_add_ps(_mm512_mul_ps(reduce16_avx512(part), _mm512_set1_ps(scale)),
                                    _mm512_maskz_loadu_ps(valid, add + r0));
    _mm512_storeu_ps(score + r0, sv);
    top = _mm512_mask_max_ps(top, valid, top, sv);
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // max is exact: any order
  // 2. weights e^(s - max), in place, and their sum per lane r % 16
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t r0 = 0; r0 < V; r0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, V - r0));
    const __mmask16 valid = static_cast<__mmask16>(count == 16 ? 0xFFFF : (1u << count) - 1);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(score + r0), mx)));
    _mm512_storeu_ps(score + r0, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  __m512 one[16];
  one[0] = lanes;
  for (int c = 1; c < 16; ++c) one[c] = _mm512_setzero_ps();
  const float total = _mm_cvtss_f32(_mm512_castps512_ps128(reduce16_avx512(one)));  // lane 0: the lane sum
  return total;
}

// Heads whose weighted sums fit the 32 vector registers with a value row's DC chunks (at most 24).
constexpr int heads_per_pass(int DC) { return (30 - DC) / DC < 24 ? (30 - DC) / DC : 24; }

// Step 3 for `heads` (<= heads_per_pass(DC)) heads of one key/value group at once, each head's as in its own
// call: out_h[D] = (sum_r score_h[r] v_r, over r in order) / total_h. Each value row is loaded
// once for all the heads, whose sums are independent chains (one head's chain waits on the FMA's
// latency at every key); every head's own operations and their order are unchanged.
template <int DC>
__attribute__((target("avx512f"))) void weighted_values_avx512(const float* vb, int64_t vs, const int64_t* pos,
                                                                int64_t V, __mmask16 tail, int heads,
                                                                const float* const* score, const float* total,
                                                                float* const* out) {
  constexpr int HB = heads_per_pass(DC);
  __m512 acc[HB][DC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t r = 0; r < V; ++r) {
    const float* vr = vb + pos[r] * vs;
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = _mm512_maskz_loadu_ps(c == DC - 1 ? tail : 0xFFFF, vr + 16 * c);
    for (int h = 0; h < HB; ++h) {
      if (h >= heads) break;
      const __m512 pb = _mm512_set1_ps(score[h][r]);
      for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_fmadd_ps(pb, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < HB && h < heads; ++h) {
    const __m512 tv = _mm512_set1_ps(total[h]);
    for (int c = 0; c < DC; ++c)
      _mm512_mask_storeu_ps(out[h] + 16 * c, c == DC - 1 ? tail : 0xFFFF, _mm512_div_ps(acc[h][c], tv));
  }
}

template <typename Fn>
void with_chunks(int64_t dc, Fn&& fn) {  // fn(std::integral_constant<int, dc>) for dc in 1..8
  switch (dc) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scaling) {
  TORCH_CHECK(isa() != Isa::none, "cascade native kernels need AVX2 + FMA + F16C or AVX-512");
  expect(q, "attention", "q", torch::kFloat32, Layout::unit_inner);
  expect(k, "attention", "k", torch::kFloat32, Layout::unit_inner);
  expect(v, "attention", "v", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, heads, length, D]");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D && v.size(3) == D,
              "k and v must be [B, Hkv, L, D] like q's D");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads (", H, ") must be a multiple of key/value heads (", Hkv, ")");
  TORCH_CHECK(n <= L, "more queries (", n, ") than keys (", L, ")");
  const float* mp = nullptr;
  int64_t ms_b = 0, ms_i = 0, ms_j = 0;
  if (mask) {
    expect(*mask, "attention", "mask", torch::kFloat32, Layout::strided);
    TORCH_CHECK(mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == n &&
                    mask->size(3) == L && (mask->size(0) == B || mask->size(0) == 1),
                "mask must be [B or 1, 1, n, L] fp32 (0 / -inf)");
    mp = mask->data_ptr<float>();
    ms_b = mask->size(0) == 1 ? 0 : mask->stride(0);
    ms_i = mask->stride(2);
    ms_j = mask->stride(3);
  }
  // mask values at or below this hide a key: its weight exp(score - max) would be exactly 0, so
  // skipping it gives the same sums (a mask may write -inf or the dtype's lowest value)
  const float hidden = -std::numeric_limits<float>::max() / 2;
  // a query that may see no key has no softmax (0 / 0): an error naming it, never a row of NaN
  for (int64_t b = 0; mp && b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const float* mi = mp + b * ms_b + i * ms_i;
      bool sees = false;
      for (int64_t j = 0; j < L && !sees; ++j) sees = mi[j * ms_j] > hidden;
      TORCH_CHECK(sees, "attention: query ", i, " of batch row ", b, " has every key masked (its softmax is undefined)");
    }
  auto out = torch::empty({B, n, H, D}, q.options());  // the layout transformers' attention functions return
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  const bool wide = isa() == Isa::avx512;
  const float scale = static_cast<float>(scaling);
  const int64_t chunks = (D + 15) / 16;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), ks0 = k.stride(0), ks1 = k.stride(1),
                ks2 = k.stride(2), vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  if (wide && chunks <= 8) {  // D <= 128: attend_weights_avx512, weighted_values_avx512
    const __mmask16 tail = static_cast<__mmask16>(D % 16 == 0 ? 0xFFFF : (1u << (D % 16)) - 1);
    // the keys each query of each batch row may see, in order (the same for every head): their
    // positions and mask values, row (b, i) at offset (b * n + i) * L
    std::vector<int64_t> pos(B * n * L), visible(B * n);
    std::vector<float> add(B * n * L + 16);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) {
        const float* mi = mp ? mp + b * ms_b + i * ms_i : nullptr;
        const int64_t limit = mp ? L : L - n + i + 1;  // keys 0 .. limit-1 are candidates
        int64_t* pi = pos.data() + (b * n + i) * L;
        float* ai = add.data() + (b * n + i) * L;
        int64_t V = 0;
        for (int64_t j = 0; j < limit; ++j) {
          const float m = mi ? mi[j * ms_j] : 0.0f;
          if (m <= hidden) continue;
          pi[V] = j;
          ai[V++] = m;
        }
        visible[b * n + i] = V;
      }
    // tasks: blocks of up to heads_per_pass heads of one key/value group (weighted_values_avx512)
    const int64_t most = heads_per_pass(static_cast<int>(chunks)), blocks = (group + most - 1) / most;
    const int64_t per_block = (group + blocks - 1) / blocks;  // the group's heads split evenly
    at::parallel_for(0, B * Hkv * blocks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> score(per_block * (L + 16));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (Hkv * blocks), g = t / blocks % Hkv, h0 = g * group + t % blocks * per_block;
        const int heads = static_cast<int>(std::min(per_block, (g + 1) * group - h0));
        const float* kb = kp + b * ks0 + g * ks1;
        const float* vb = vp + b * vs0 + g * vs1;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t row = b * n + i;
          const float* scores[24];
          float totals[24];
          float* outs[24];
          with_chunks(chunks, [&](auto dc) {
            constexpr int DC = decltype(dc)::value;
            for (int j = 0; j < heads; ++j) {
              float* sj = score.data() + j * (L + 16);
              totals[j] = attend_weights_avx512<DC>(qp + b * qs0 + (h0 + j) * qs1 + i * qs2, kb, ks2, pos.data() + row * L,
                                                    add.data() + row * L, visible[row], scale, tail, sj);
              scores[j] = sj;
              outs[j] = op + (row * H + h0 + j) * D;
            }
            weighted_values_avx512<DC>(vb, vs2, pos.data() + row * L, visible[row], tail, heads, scores, totals, outs);
          });
        }
      }
    });
    return out;
  }
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(L);
    std::vector<float> acc(D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / group;
      const float* kb = kp + b * ks0 + g * ks1;
      const float* vb = vp + b * vs0 + g * vs1;
      for (int64_t i = 0; i < n; ++i) {
        const float* qi = qp + b * qs0 + h * qs1 + i * qs2;
        const float* mi = mp ? mp + b * ms_b + i * ms_i : nullptr;
        const int64_t limit = mp ? L : L - n + i + 1;  // keys 0 .. limit-1 are candidates
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < limit; ++j) {
          const float add = mi ? mi[j * ms_j] : 0.0f;
          if (add <= hidden) {  // a key this query may not see (-inf, or the dtype's min as transformers writes it)
            score[j] = -std::numeric_limits<float>::infinity();
            continue;
          }
          const float* kj = kb + j * ks2;
          const float s = (wide ? dot_avx512(qi, kj, D) : dot_avx2(qi, kj, D)) * scale + add;
          score[j] = s;
          top = std::max(top, s);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        for (int64_t j = 0; j < limit; ++j) {
          if (score[j] == -std::numeric_limits<float>::infinity()) continue;
          const float p = std::exp(score[j] - top);
          total += p;
          const float* vj = vb + j * vs2;
          if (wide) axpy_avx512(p, vj, acc.data(), D);
          else axpy_avx2(p, vj, acc.data(), D);
        }
        float* oi = op + ((b * n + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] / total;
      }
    }
  });
  return out;
}

// ---- int8 x int8 (AVX-512 VNNI): a drafter's multi-row path ------------------------------------
// Activations quantized per row (symmetric, scale max|x| / 127, stored offset by 128 as uint8),
// weights int8 per output channel packed [P, K4 / 4, 32, 4] (four consecutive k of a column
// side by side, the operand order of vpdpbusd), int32 sums:
// y = (sum_k (xq_k - 128) q_k) * sx * s_w (+ bias) = (dot(xq, q) - 128 colsum(q)) * sx * s_w.
// Four times the multiply-adds per instruction of fp32 FMA, so a tree level or a catch-up
// forward of several rows costs little more than one row. Not exact (activations are rounded),
// which a drafter may be: q is whatever it sampled from.

// max |x_k| over a row (exact: max does not round, so the order is free).
__attribute__((target("avx512f"))) float row_amax(const float* x, int64_t K) {
  __m512 m = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float amax = _mm512_reduce_max_ps(m);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// quantize_row's scalar form over k0 .. K - 1 (the vector loops' tails): returns sum q_k.
template <bool Divide>
int32_t quantize_scalar(const float* x, int64_t k0, int64_t K, float s, int8_t* q) {
  int32_t total = 0;
  for (int64_t k = k0; k < K; ++k) {
    const float v = Divide ? x[k] / s : x[k] * s;
    const int r = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(v))));
    q[k] = static_cast<int8_t>(r);
    total += r;
  }
  return total;
}

// q_k = clamp(round(x_k op s), -127, 127), op: divide (int8_vnni) or multiply (int4_vnni, s the
// reciprocal), rounding to nearest even as std::nearbyint does; returns sum_k q_k. Vectorized
// (the quantization was a scalar loop costing ~10-25 us per row of 896-4864, a third of a
// drafter's small matmul) with results identical to the scalar form.
template <bool Divide>
__attribute__((target("avx512f,avx512bw"))) int32_t quantize_row(const float* x, int64_t K, float s, int8_t* q) {
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i sum = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = Divide ? _mm512_div_ps(_mm512_loadu_ps(x + k), sv) : _mm512_mul_ps(_mm512_loadu_ps(x + k), sv);
    const __m512i r = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    sum = _mm512_add_epi32(sum, r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(r));
  }
  return _mm512_reduce_add_epi32(sum) + quantize_scalar<Divide>(x, k, K, s, q);
}

template <int MR, int PP>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_rows(const uint8_t* xq, int64_t ldxq, const float* sx,
                                                                       const int8_t* panel, int64_t pstride, int64_t K4,
                                                                       const int32_t* colsum, const float* scale,
                                                                       const float* bias, float* y, int64_t ldy,
                                                                       int ncols) {
  __m512i acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4 / 4; ++g) {
    __m512i w[PP][2];
    for (int q = 0; q < PP; ++q) {
      const int8_t* wg = panel + q * pstride + g * 128;
      prefetch_ahead(wg);
      w[q][0] = _mm512_loadu_si512(wg);
      w[q][1] = _mm512_loadu_si512(wg + 64);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, xq + m * ldxq + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int q = 0; q < PP; ++q) {
        acc[q][m][0] = _mm512_dpbusd_epi32(acc[q][m][0], xb, w[q][0]);
        acc[q][m][1] = _mm512_dpbusd_epi32(acc[q][m][1], xb, w[q][1]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const PanelMasks pm = panel_masks(q == PP - 1 ? ncols : NC);
    const int32_t* cs = colsum + q * NC;
    const float* sc = scale + q * NC;
    const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(cs), 7), c1 = _mm512_slli_epi32(_mm512_loadu_si512(cs + 16), 7);
    const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xs = _mm512_set1_ps(sx[m]);
      __m512 a0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[q][m][0], c0)), _mm512_mul_ps(s0, xs));
      __m512 a1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[q][m][1], c1)), _mm512_mul_ps(s1, xs));
      store_row(y + m * ldy + q * NC, a0, a1, bias ? bias + q * NC : nullptr, pm);
    }
  }
}

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

torch::Tensor linear_int8_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& colsum,
                               const torch::Tensor& scale, int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), "the int8 x int8 kernel needs AVX-512 VNNI");
  expect(x, "linear_int8_vnni", "x", torch::kFloat32, Layout::unit_inner);
  expect(packed, "linear_int8_vnni", "packed", torch::kInt8, Layout::contiguous);
  expect(colsum, "linear_int8_vnni", "colsum", torch::kInt32, Layout::contiguous);
  expect(scale, "linear_int8_vnni", "scale", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(x.dim() == 2, "linear_int8_vnni: x must be 2-D [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NC && packed.size(3) == 4, "packed weight must be [P, K4 / 4, 32, 4] int8");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), K4 = packed.size(1) * 4, ldx = x.stride(0);
  TORCH_CHECK(K4 >= K && K4 - K < 4, "x has K = ", K, ", the weight ", K4, " (padded to 4)");
  TORCH_CHECK(N > (P - 1) * NC && N <= P * NC, "N = ", N, " does not match ", P, " panels");
  TORCH_CHECK(colsum.numel() == P * NC && scale.numel() == P * NC, "colsum [P * 32] int32 and scale [P * 32] fp32");
  expect_bias(bias, "linear_int8_vnni", N);
  // 1. quantize each row: xq = round(x / sx) + 128, sx = max|x| / 127 (padding k: 128, i.e. zero)
  auto xq = torch::full({M, K4}, 128, x.options().dtype(torch::kUInt8));
  auto sx = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = sx.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float amax = row_amax(xp + m * ldx, K);
    const float s = amax > 0 ? amax / 127.0f : 1.0f;
    sp[m] = s;
    int8_t* row = reinterpret_cast<int8_t*>(qp + m * K4);
    quantize_row<true>(xp + m * ldx, K, s, row);
    for (int64_t k = 0; k < K; ++k) qp[m * K4 + k] = static_cast<uint8_t>(row[k] + 128);
  }
  // 2. the int8 products, panels split between the threads
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = colsum.data_ptr<int32_t>();
  const float* scp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_panel_groups(P, [&](int64_t pg, int count) {
    run_rows(M, MR512, [&](int64_t r0, int rows) {
      with_rows<8>(rows, [&](auto r) {
        constexpr int MR = decltype(r)::value;
        panel_passes<MR>(count, [&](int q, auto pp) {
          constexpr int PP = decltype(pp)::value;
          const int64_t p = pg + q;
          vnni_rows<MR, PP>(qp + r0 * K4, K4, sp + r0, wp + p * K4 * NC, K4 * NC, K4, cp + p * NC, scp + p * NC,
                            bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, pass_ncols(N, p, PP));
        });
      });
    });
  });
  return y;
}

// ---- int4 x int8 (AVX-512 VNNI): a drafter's cheapest token ----------------------------------
// The int4 weights of "int4_native" (0..15, w = (q - 8) * s per column and group of G k) times
// int8 activations quantized per row (symmetric, sx = max|x| / 127, xq in -127..127), int32 sums
// per group: y = sx * sum_g s_g * (dot_g(q, xq) - 8 * sum_g(xq)) (+ bias). Why: with fp32
// arithmetic (int4_native) every weight costs an unpack, a conversion and an FMA lane, so one
// row runs at ~2x the time its bytes need; vpdpbusd multiplies 64 unsigned nibble values by 64
// signed bytes per instruction, with only a mask and a shift to unpack. Packed [P, K4 / 4, 64]
// bytes: per four consecutive k, byte 4c + j holds column c (low nibble) and column c + 16 (high
// nibble) at k = 4 g + j, the operand order of vpdpbusd. Not exact (activations rounded), which
// a drafter may be. Row-invariant: integer sums are exact and each row's float steps run in one
// order whatever the other rows.

template <int MR, int PP, int SPLIT = 1>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_vnni_rows(const int8_t* xq, int64_t ldxq,
                                                                            const int32_t* xsum, int64_t ldxs,
                                                                            const float* sx, const uint8_t* panel,
                                                                            int64_t pstride, int64_t K, int64_t G,
                                                                            const float* scales, int64_t sstride,
                                                                            const float* bias, float* y, int64_t ldy,
                                                                            int ncols) {
  __m512 acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512i iacc[SPLIT][PP][MR][2];
    for (int u = 0; u < SPLIT; ++u)
      for (int q = 0; q < PP; ++q)
        for (int m = 0; m < MR; ++m) iacc[u][q][m][0] = iacc[u][q][m][1] = _mm512_setzero_si512();
    for (int64_t k4 = g * G / 4; k4 < (g + 1) * G / 4; k4 += SPLIT) {
      for (int u = 0; u < SPLIT; ++u) {
        __m512i w[PP][2];
        for (int q = 0; q < PP; ++q) {
          const uint8_t* wg = panel + q * pstride + (k4 + u) * 64;
          prefetch_ahead(wg);
          const __m512i v = _mm512_loadu_si512(wg);
          w[q][0] = _mm512_and_si512(v, low);
          w[q][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int m = 0; m < MR; ++m) {
          int32_t four;
          std::memcpy(&four, xq + m * ldxq + 4 * (k4 + u), 4);
          const __m512i xb = _mm512_set1_epi32(four);
          for (int q = 0; q < PP; ++q) {
            iacc[u][q][m][0] = _mm512_dpbusd_epi32(iacc[u][q][m][0], w[q][0], xb);
            iacc[u][q][m][1] = _mm512_dpbusd_epi32(iacc[u][q][m][1], w[q][1], xb);
          }
        }
      }
    }
    for (int u = 1; u < SPLIT; ++u)  // integer sums: exact in any order
      for (int q = 0; q < PP; ++q)
        for (int m = 0; m < MR; ++m)
          for (int h = 0; h < 2; ++h) iacc[0][q][m][h] = _mm512_add_epi32(iacc[0][q][m][h], iacc[u][q][m][h]);
    for (int q = 0; q < PP; ++q) {
      const float* sg = scales + q * sstride + g * NC;
      prefetch_scales(sg, G);
      const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512i off = _mm512_set1_epi32(8 * xsum[m * ldxs + g]);
        acc[q][m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[0][q][m][0], off)), s0, acc[q][m][0]);
        acc[q][m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[0][q][m][1], off)), s1, acc[q][m][1]);
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const PanelMasks pm = panel_masks(q == PP - 1 ? ncols : NC);
    for (int m = 0; m < MR; ++m) {
      const __m512 xs = _mm512_set1_ps(sx[m]);
      store_row(y + m * ldy + q * NC, _mm512_mul_ps(acc[q][m][0], xs), _mm512_mul_ps(acc[q][m][1], xs),
                bias ? bias + q * NC : nullptr, pm);
    }
  }
}

// int4 x int8 on AVX2 (no VNNI): vpdpbusd's sum of four u8 x s8 products per 32-bit lane as
// vpmaddubsw (u8 x s8 -> s16 pair sums, at most 2 * 15 * 127 = 3810: no saturation) then
// vpmaddwd with ones (-> s32): the same integer sums, and the float steps of int4_vnni_rows in
// its order, so the result is bitwise the AVX-512 kernel's. Why: on AVX2 int4_native's unpack,
// convert and FMA per weight bind a one-row call at ~2x its bytes' time; this is ~3x fewer
// instructions per weight. A 64-byte block of four k holds columns 0-7 / 16-23 in bytes 0-31
// (low / high nibbles) and 8-15 / 24-31 in bytes 32-63: iacc[q][m][v] sums columns 8v .. 8v + 7.
// MR <= 2 (more rows go two at a time, the panel re-read from cache).
template <int MR, int PP>
__attribute__((target("avx2,fma,f16c"))) void int4_i8_rows_avx2(const int8_t* xq, int64_t ldxq, const int32_t* xsum,
                                                                 int64_t ldxs, const float* sx, const uint8_t* panel,
                                                                 int64_t pstride, int64_t K, int64_t G,
                                                                 const float* scales, int64_t sstride,
                                                                 const float* bias, float* y, int64_t ldy, int ncols) {
  __m256 acc[PP][MR][4];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) acc[q][m][v] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K / G; ++g) {
    __m256i iacc[PP][MR][4];
    for (int q = 0; q < PP; ++q)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v) iacc[q][m][v] = _mm256_setzero_si256();
    for (int64_t k4 = g * G / 4; k4 < (g + 1) * G / 4; ++k4) {
      __m256i w[PP][4];
      for (int q = 0; q < PP; ++q) {
        const uint8_t* wg = panel + q * pstride + k4 * 64;
        prefetch_ahead(wg);
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32));
        w[q][0] = _mm256_and_si256(a, low);
        w[q][1] = _mm256_and_si256(b, low);
        w[q][2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
        w[q][3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, xq + m * ldxq + 4 * k4, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int q = 0; q < PP; ++q)
          for (int v = 0; v < 4; ++v)
            iacc[q][m][v] = _mm256_add_epi32(iacc[q][m][v], _mm256_madd_epi16(_mm256_maddubs_epi16(w[q][v], xb), ones));
      }
    }
    for (int q = 0; q < PP; ++q) {
      prefetch_scales(scales + q * sstride + g * NC, G);
      for (int m = 0; m < MR; ++m) {
        const __m256i off = _mm256_set1_epi32(8 * xsum[m * ldxs + g]);
        for (int v = 0; v < 4; ++v) {
          const __m256 sg = _mm256_loadu_ps(scales + q * sstride + g * NC + 8 * v);
          acc[q][m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[q][m][v], off)), sg, acc[q][m][v]);
        }
      }
    }
  }
  for (int q = 0; q < PP; ++q) {
    const int nq = q == PP - 1 ? ncols : NC;
    for (int m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_set1_ps(sx[m]);
      for (int v = 0; v < 4; ++v) {
        const int c = 8 * v;
        __m256 a = _mm256_mul_ps(acc[q][m][v], xs);
        if (bias) a = _mm256_add_ps(a, load8(bias + q * NC + c, c, nq));
        store8(y + m * ldy + q * NC + c, a, c, nq);
      }
    }
  }
}

// row_amax / quantize_row (multiply form) on AVX2, the same results: max does not round, and
// vcvtps2dq rounds to nearest even under the default MXCSR, as std::nearbyint does.
__attribute__((target("avx2,fma,f16c"))) float row_amax_avx2(const float* x, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

__attribute__((target("avx2,fma,f16c"))) int32_t quantize_row_avx2(const float* x, int64_t K, float s, int8_t* q) {
  const __m256 sv = _mm256_set1_ps(s);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i sum = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256i r = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), sv)), lo), hi);
    sum = _mm256_add_epi32(sum, r);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // in range: exact
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int32_t total = 0;
  for (int32_t v : lanes) total += v;
  return total + quantize_scalar<false>(x, k, K, s, q);
}

// Which kernel the int4 x int8 path runs here: AVX-512 VNNI, AVX2 (vpmaddubsw) or none.
std::string int8_dot_isa() { return has_vnni() ? "avx512_vnni" : isa() != Isa::none ? "avx2" : "none"; }

torch::Tensor linear_int4_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                               int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias) {
  const bool vnni = has_vnni();
  TORCH_CHECK(vnni || isa() != Isa::none, "the int4 x int8 kernel needs AVX-512 VNNI or AVX2");
  expect(x, "linear_int4_vnni", "x", torch::kFloat32, Layout::unit_inner);
  expect(packed, "linear_int4_vnni", "packed", torch::kUInt8, Layout::contiguous);
  expect(scales, "linear_int4_vnni", "scales", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(x.dim() == 2, "linear_int4_vnni: x must be 2-D [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64, "packed weight must be [P, K / 4, 64] uint8");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), ldx = x.stride(0);
  TORCH_CHECK(packed.size(1) * 4 == K, "x has K = ", K, ", the weight ", packed.size(1) * 4);
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "K = ", K, " is not a multiple of the group size ", group);
  TORCH_CHECK(N > (P - 1) * NC && N <= P * NC, "N = ", N, " does not match ", P, " panels");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == P && scales.size(1) == K / group && scales.size(2) == NC,
              "scales must be [P, K / group, 32] fp32");
  expect_bias(bias, "linear_int4_vnni", N);
  // 1. quantize each row: xq = round(x / sx), sx = max|x| / 127; per group the sum of xq
  const int64_t ldxs = K / group;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xsum = torch::empty({M, ldxs}, x.options().dtype(torch::kInt32));
  auto sx = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  int32_t* xs = xsum.data_ptr<int32_t>();
  float* sp = sx.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float amax = vnni ? row_amax(xp + m * ldx, K) : row_amax_avx2(xp + m * ldx, K);
    const float s = amax > 0 ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / s;
    sp[m] = s;
    for (int64_t g = 0; g < ldxs; ++g) {
      const float* xg = xp + m * ldx + g * group;
      int8_t* qg = qp + m * K + g * group;
      xs[m * ldxs + g] = vnni ? quantize_row<false>(xg, group, inv, qg) : quantize_row_avx2(xg, group, inv, qg);
    }
  }
  // 2. the products, panels split between the threads
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* scp = scales.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t sstride = (K / group) * NC, pstride = K / 4 * 64;
  for_panel_groups(P, [&](int64_t pg, int count) {
    if (!vnni) {  // AVX2: two rows per pass over one panel, one row over two panels side by side
      run_rows(M, 2, [&](int64_t r0, int rows) {
        const auto pass = [&](int64_t p, auto mr, auto pp) {
          constexpr int MR = decltype(mr)::value, PP = decltype(pp)::value;
          int4_i8_rows_avx2<MR, PP>(qp + r0 * K, K, xs + r0 * ldxs, ldxs, sp + r0, wp + p * pstride, pstride, K, group,
                                    scp + p * sstride, sstride, bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N,
                                    pass_ncols(N, p, PP));
        };
        int q = 0;
        if (rows == 1)
          for (; q + 2 <= count; q += 2) pass(pg + q, std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{});
        for (; q < count; ++q) {
          if (rows == 1) pass(pg + q, std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
          else pass(pg + q, std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{});
        }
      });
      return;
    }
    run_rows(M, 4, [&](int64_t r0, int rows) {
      // One row: one panel's stream at a time (four concurrent streams per thread read slower
      // than one), its dot products split over four integer accumulators per half (exact, so
      // bitwise the blocked path) to keep eight vpdpbusd chains in flight: 1.19-1.27x on the
      // 0.5B's layers (results/kernels/linear_revision_one_stream.log).
      if (rows == 1 && group % 16 == 0) {
        for (int q = 0; q < count; ++q) {
          const int64_t p = pg + q;
          int4_vnni_rows<1, 1, 4>(qp + r0 * K, K, xs + r0 * ldxs, ldxs, sp + r0, wp + p * pstride, pstride, K, group,
                                  scp + p * sstride, sstride, bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N,
                                  pass_ncols(N, p, 1));
        }
        return;
      }
      with_rows<4>(rows, [&](auto r) {
        constexpr int MR = decltype(r)::value;
        panel_passes<MR>(count, [&](int q, auto pp) {
          constexpr int PP = decltype(pp)::value;
          const int64_t p = pg + q;
          int4_vnni_rows<MR, PP>(qp + r0 * K, K, xs + r0 * ldxs, ldxs, sp + r0, wp + p * pstride, pstride, K, group,
                                 scp + p * sstride, sstride, bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N,
                                 pass_ncols(N, p, PP));
        });
      });
    });
  });
  return y;
}

// ---- the lean forward's per-row operations, as one call each ---------------------------------
// The same ATen operations, in the same order, as transformers' Llama / Qwen2 RMSNorm, rotary
// embedding and gated MLP (so the results are bitwise theirs; the lean forward checks that once
// per model and otherwise calls the modules): what this saves is the interpreter's work between
// the operations.

// ATen's fp32 sum over a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum on
// an inner reduction), reproduced operation for operation so that the sum of squares below is
// bitwise ATen's: the row read as vectors of W lanes (W = Vectorized<float>::size() of the
// kernels ATen dispatches to: 16 on AVX-512, 8 otherwise); the vectors summed four interleaved
// accumulators at a time, each through four levels of partial sums (level l folds into l + 1
// every 2^p items, p = max(4, ceil_log2(items) / 4)); leftover vectors into accumulator 0; the
// four accumulators summed in order; then a scalar sum of the elements past the last whole
// vector, plus the W lanes in order. A row shorter than W takes ATen's scalar path: the same
// scheme with one lane and no lane sum. Every step is a plain fp32 addition (no contraction:
// -ffp-contract=off), so the compiler may vectorize the lane loops without changing a bit.

int64_t aten_ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

// multi_row_sum + row_sum: sum of `items` groups of 4 W-lane vectors, vector j of item i at
// load(4 * i + j); out[W] = the row's W-lane partial sum.
template <int W, typename Load>
void cascade_lanes(int64_t vectors, Load&& load, float* out) {
  constexpr int levels = 4, ilp = 4;
  const int64_t items = vectors / ilp;
  const int64_t power = std::max<int64_t>(4, aten_ceil_log2(items) / levels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[levels][ilp][W] = {};
  float v[W];
  auto add_item = [&](int64_t i) {
    for (int j = 0; j < ilp; ++j) {
      load(ilp * i + j, v);
      for (int l = 0; l < W; ++l) acc[0][j][l] += v[l];
    }
  };
  int64_t i = 0;
  while (i + step <= items) {
    for (int64_t s = 0; s < step; ++s, ++i) add_item(i);
    for (int lv = 1; lv < levels; ++lv) {
      for (int j = 0; j < ilp; ++j)
        for (int l = 0; l < W; ++l) {
          acc[lv][j][l] += acc[lv - 1][j][l];
          acc[lv - 1][j][l] = 0.0f;
        }
      if ((i & (mask << (lv * power))) != 0) break;
    }
  }
  for (; i < items; ++i) add_item(i);
  for (int lv = 1; lv < levels; ++lv)
    for (int j = 0; j < ilp; ++j)
      for (int l = 0; l < W; ++l) acc[0][j][l] += acc[lv][j][l];
  for (int64_t r = items * ilp; r < vectors; ++r) {  // leftover vectors
    load(r, v);
    for (int l = 0; l < W; ++l) acc[0][0][l] += v[l];
  }
  for (int j = 1; j < ilp; ++j)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][j][l];
  for (int l = 0; l < W; ++l) out[l] = acc[0][0][l];
}

// sum of x[k]^2 over a contiguous row of E, in ATen's order (x.pow(2) is x * x, exactly rounded)
template <int W>
float aten_sum_of_squares(const float* x, int64_t E) {
  if (E < W) {  // ATen's scalar_inner_sum
    float s;
    cascade_lanes<1>(E, [&](int64_t r, float* v) { v[0] = x[r] * x[r]; }, &s);
    return s;
  }
  const int64_t vectors = E / W;
  float lanes[W];
  cascade_lanes<W>(vectors, [&](int64_t r, float* v) {
    for (int l = 0; l < W; ++l) v[l] = x[r * W + l] * x[r * W + l];
  }, lanes);
  float total = 0.0f;
  for (int64_t k = vectors * W; k < E; ++k) total += x[k] * x[k];
  for (int l = 0; l < W; ++l) total += lanes[l];
  return total;
}

// transformers' Llama / Qwen2 RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) with the fp32
// weight and input it runs on. `lanes` 16 or 8: ATen's vector width (the Python side reads
// torch's dispatch capability, and the lean forward checks the result bitwise against the
// module once per model); 0: ATen's own operations (any dtype). The native loop reproduces
// ATen's: mean is the cascade sum divided by E; `+ eps` adds the fp32-rounded eps; rsqrt is
// 1 / sqrt (both correctly rounded, as ATen's vector and scalar rsqrt); then two products.
struct NormOp {
  torch::Tensor weight;  // [E]
  double eps;
  int64_t lanes;

  torch::Tensor operator()(const torch::Tensor& x) const {  // [n, E] -> [n, E]
    // dtypes other than fp32 take ATen's ops (below); the native loop reads x and weight on the CPU
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: x and weight must be on the CPU, got ",
                x.device(), " and ", weight.device());
    const bool native = (lanes == 8 || lanes == 16) && x.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
                        weight.scalar_type() == torch::kFloat32 && x.size(1) == weight.numel() &&
                        x.size(1) < 32768;  // ATen splits a longer single row over threads (another order)
    if (!native) {
      auto h = x.to(torch::kFloat32);
      auto variance = h.pow(2).mean(-1, true);
      h = h * torch::rsqrt(variance + eps);
      return weight * h.to(x.scalar_type());
    }
    auto xc = x.contiguous();
    auto wc = weight.contiguous();
    const int64_t n = xc.size(0), E = xc.size(1);
    auto out = torch::empty({n, E}, xc.options());
    const float* xp = xc.data_ptr<float>();
    const float* wp = wc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float feps = static_cast<float>(eps), fE = static_cast<float>(E);
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = xp + i * E;
      const float sum = lanes == 16 ? aten_sum_of_squares<16>(xi, E) : aten_sum_of_squares<8>(xi, E);
      const float r = 1.0f / std::sqrt(sum / fE + feps);
      float* oi = op + i * E;
      for (int64_t e = 0; e < E; ++e) oi[e] = wp[e] * (xi[e] * r);
    }
    return out;
  }
};

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t lanes) {
  return NormOp{weight, eps, lanes}(x);
}

// transformers' apply_rotary_pos_emb for one of q / k: (x * cos) + (rotate_half(x) * sin),
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). Each output element is the same three
// roundings as ATen's three elementwise operations (a product, a product, their sum; negation is
// exact), so one loop gives their result bit for bit without a dispatch per operation.
// x [1, H, n, D] (any strides, unit along D), cos / sin [1, 1, n, D] -> out [1, H, n, D] (any
// strides, unit along D: a fresh tensor, or the cache's slots for this call's keys).
void rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  expect(x, "rope", "x", torch::kFloat32, Layout::unit_inner);
  expect(cos, "rope", "cos", torch::kFloat32, Layout::strided);  // expanded and made contiguous below
  expect(sin, "rope", "sin", torch::kFloat32, Layout::strided);
  expect(out, "rope", "out", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(x.dim() == 4 && x.size(0) == 1, "rope: x must be [1, H, n, D] fp32 with unit stride along D");
  const int64_t H = x.size(1), n = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rope: D must be even");
  TORCH_CHECK(out.sizes() == x.sizes(), "rope: out must be fp32 shaped like x with unit stride along D");
  auto c = cos.expand({1, 1, n, D}).contiguous(), s = sin.expand({1, 1, n, D}).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = xp + h * x.stride(1) + i * x.stride(2);
      const float* ci = cp + i * D;
      const float* si = sp + i * D;
      float* oi = op + h * out.stride(1) + i * out.stride(2);
      for (int64_t d = 0; d < half; ++d) {
        const float a = xi[d] * ci[d], b = -xi[d + half] * si[d];
        oi[d] = a + b;
      }
      for (int64_t d = half; d < D; ++d) {
        const float a = xi[d] * ci[d], b = xi[d - half] * si[d];
        oi[d] = a + b;
      }
    }
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto out = torch::empty(x.sizes(), x.options());
  rope_into(x, cos, sin, out);
  return out;
}

// silu(gate) * up: ATen's silu (its vectorized exp; the lean forward needs its bits), then the
// product as one loop (one rounding, as ATen's mul). gate [n, I] is made contiguous first, as
// the separate projection's output is (ATen's vector and scalar exp may differ in the last bit,
// and its loop runs a contiguous tensor as one run). up [n, I], unit stride along I.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  expect(gate, "silu_mul", "gate", torch::kFloat32, Layout::strided);  // made contiguous below
  expect(up, "silu_mul", "up", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes(), "silu_mul: fp32 [n, I] gate and up");
  auto out = torch::silu(gate.contiguous());  // [n, I], fresh
  const int64_t n = out.size(0), I = out.size(1);
  const int64_t up_row = up.stride(0);
  for (int64_t i = 0; i < n; ++i) {  // restrict: out is fresh, so the loop vectorizes (a product rounds the same in any lane)
    float* __restrict oi = out.data_ptr<float>() + i * I;
    const float* __restrict ui = up.data_ptr<float>() + i * up_row;
    for (int64_t j = 0; j < I; ++j) oi[j] *= ui[j];
  }
  return out;
}

// y += h in place (y fresh [n, E] from a linear; h [n, E]): the residual, h + y bit for bit.
torch::Tensor add_residual(torch::Tensor y, const torch::Tensor& h) {
  expect(y, "add_residual", "y", torch::kFloat32, Layout::contiguous);
  expect(h, "add_residual", "h", torch::kFloat32, Layout::strided);  // made contiguous below
  TORCH_CHECK(y.sizes() == h.sizes(), "add_residual: fp32 y, h of one shape, y contiguous");
  auto hc = h.contiguous();
  float* __restrict yp = y.data_ptr<float>();  // y is fresh: no alias with h
  const float* __restrict hp = hc.data_ptr<float>();
  for (int64_t i = 0, count = y.numel(); i < count; ++i) yp[i] = hp[i] + yp[i];
  return y;
}

// ---- the lean forward's decoder layer ------------------------------------------------------
// What a layer of the lean forward does, as native calls: the Python interpreter's work between
// ~20 small operations per layer was ~0.15-0.2 ms of a drafter's layer (a third of the int4
// 0.5B's token). The same operations, in the same order, on the same kernels as the per-op path
// (cascade/models/lean.py), so the results are bitwise the same (tested against transformers'
// forward).

// A native linear layer as these calls run it: which kernel, and the tensors it reads (shared
// with the Python module that made it; nothing is copied).
struct LinearOp {
  enum Kind { fp16 = 0, int8 = 1, int8_vnni = 2, int4 = 3, int4_vnni = 4 };
  int64_t kind;
  torch::Tensor packed, scale, colsum;  // scale: int8 [P*32] / int4 scales [P, K/G, 32]; colsum: int8_vnni
  int64_t group, N;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case fp16: return linear_fp16(x, packed, N, bias);
      case int8: return linear_int8(x, packed, scale, N, bias);
      case int8_vnni: return linear_int8_vnni(x, packed, colsum, scale, N, bias);
      case int4: return linear_int4(x, packed, scale, group, N, bias);
      case int4_vnni: return linear_int4_vnni(x, packed, scale, group, N, bias);
    }
    TORCH_CHECK(false, "unknown LinearOp kind ", kind);
  }
};

// Linear layers that read the same input as one call: either one op whose output columns are
// the parts' side by side (their panels concatenated, cascade/models/native.py: side_by_side; every
// column computed as in its own layer, so bitwise the separate calls), or the separate ops,
// whose outputs are concatenated. -> [n, sum of widths].
torch::Tensor side_by_side(const std::vector<LinearOp>& ops, const torch::Tensor& x) {
  if (ops.size() == 1) return ops[0](x);
  std::vector<torch::Tensor> parts;
  for (const auto& op : ops) parts.push_back(op(x));
  return torch::cat(parts, 1);
}

// One decoder layer's operators (built once per layer in Python: cascade/models/lean.py).
struct LayerOps {
  NormOp in_norm;
  std::vector<LinearOp> qkv;  // q, k, v side by side (widths nq, nk, the rest)
  int64_t nq, nk, head_dim;
  LinearOp o_proj;
  NormOp post_norm;
  std::vector<LinearOp> gate_up;  // gate, up side by side (equal widths)
  LinearOp down_proj;
  double scaling;
};

// h [n, E] -> q [1, H, n, D] (fresh) and the layer's keys and values for this call written into
// k_out / v_out [1, Hkv, n, D]: the input norm, the projections, RoPE on q and k.
torch::Tensor qkv_part(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& cos, const torch::Tensor& sin,
                       torch::Tensor& k_out, torch::Tensor& v_out) {
  const int64_t n = h.size(0), D = L.head_dim;
  auto y = side_by_side(L.qkv, L.in_norm(h));  // [n, nq + nk + nv]
  auto q = y.narrow(1, 0, L.nq).view({1, n, -1, D}).transpose(1, 2);
  auto k = y.narrow(1, L.nq, L.nk).view({1, n, -1, D}).transpose(1, 2);
  auto v = y.narrow(1, L.nq + L.nk, y.size(1) - L.nq - L.nk).view({1, n, -1, D}).transpose(1, 2);
  rope_into(k, cos, sin, k_out);
  v_out.copy_(v);
  return rope(q, cos, sin);
}

// The rest of the layer once keys / values [1, Hkv, L, D] hold this call's: attention, o_proj,
// the residual, the post-attention norm, the gated MLP, the residual.
torch::Tensor rest_part(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& keys,
                        const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, const LayerOps& L) {
  const int64_t n = h.size(0);
  auto out = attention(q, keys, values, mask, L.scaling);  // [1, n, H, D]
  auto h1 = add_residual(L.o_proj(out.reshape({n, -1})), h);
  auto y = side_by_side(L.gate_up, L.post_norm(h1));  // [n, 2 I]: gate, up
  const int64_t inter = y.size(1) / 2;
  return add_residual(L.down_proj(silu_mul(y.narrow(1, 0, inter), y.narrow(1, inter, inter))), h1);
}

// The layer around a cache update made in Python (a cache whose layers are not
// cascade's preallocated buffers): [q, k, v] fresh, then rest_part.
std::vector<torch::Tensor> layer_qkv(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t n = h.size(0), D = L.head_dim, kv_heads = L.nk / D;
  auto k = torch::empty({1, kv_heads, n, D}, h.options());
  auto v = torch::empty({1, kv_heads, n, D}, h.options());
  auto q = qkv_part(h, L, cos, sin, k, v);
  return {q, k, v};
}

torch::Tensor layer_rest(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& keys,
                         const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, const LayerOps& L) {
  return rest_part(h, q, keys, values, mask, L);
}

// The whole layer as one call on a preallocated cache: this call's keys / values are written
// straight into positions [start, start + n) of the buffers k_buf / v_buf [1, Hkv, capacity, D]
// (reserved by the caller, cascade/models/kv_cache.py), and the attention reads positions
// [0, start + n) of them. Bitwise layer_qkv + the cache's update + layer_rest.
torch::Tensor layer_step(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                         int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                         const c10::optional<torch::Tensor>& mask) {
  const int64_t n = h.size(0);
  expect(h, "layer_step", "h", torch::kFloat32, Layout::unit_inner);
  expect(k_buf, "layer_step", "k_buf", torch::kFloat32, Layout::unit_inner);
  expect(v_buf, "layer_step", "v_buf", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.sizes() == k_buf.sizes() && start >= 0 && start + n <= k_buf.size(2),
              "layer_step: k_buf / v_buf [1, Hkv, capacity, D] with room for positions [start, start + n)");
  auto k_out = k_buf.narrow(2, start, n), v_out = v_buf.narrow(2, start, n);
  auto q = qkv_part(h, L, cos, sin, k_out, v_out);
  return rest_part(h, q, k_buf.narrow(2, 0, start + n), v_buf.narrow(2, 0, start + n), mask, L);
}

// Every decoder layer in one call (each as layer_step), for a forward whose layers are all
// fused and whose cache layers are all preallocated: the interpreter's work per layer (the call,
// its arguments) was ~10-20 us of a drafter's ~0.35 ms layer. layer i writes this call's keys
// and values into k_bufs[i] / v_bufs[i] at starts[i]. Returns [h after the last layer] then, for
// each entry of keep_after (a count of layers, 1 <= c <= the layer count), h after that many
// layers.
struct DecoderOps {
  std::vector<LayerOps> layers;
};

std::vector<torch::Tensor> decoder_step(torch::Tensor h, const DecoderOps& D, const std::vector<torch::Tensor>& k_bufs,
                                        const std::vector<torch::Tensor>& v_bufs, const std::vector<int64_t>& starts,
                                        const torch::Tensor& cos, const torch::Tensor& sin,
                                        const c10::optional<torch::Tensor>& mask, const std::vector<int64_t>& keep_after) {
  const size_t count = D.layers.size();
  TORCH_CHECK(k_bufs.size() == count && v_bufs.size() == count && starts.size() == count,
              "decoder_step: one key buffer, value buffer and start per layer (", count, " layers)");
  for (int64_t c : keep_after)
    TORCH_CHECK(c >= 1 && c <= static_cast<int64_t>(count), "decoder_step: keep_after counts layers in [1, ", count, "]");
  std::vector<torch::Tensor> kept(keep_after.size());
  for (size_t i = 0; i < count; ++i) {
    h = layer_step(h, D.layers[i], k_bufs[i], v_bufs[i], starts[i], cos, sin, mask);
    for (size_t j = 0; j < keep_after.size(); ++j)
      if (keep_after[j] == static_cast<int64_t>(i + 1)) kept[j] = h;
  }
  std::vector<torch::Tensor> out{h};
  out.insert(out.end(), kept.begin(), kept.end());
  return out;
}

std::string isa_name() {
  switch (isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "none";
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<LinearOp>(m, "LinearOp", "a native linear layer as layer_qkv / layer_rest run it")
      .def(py::init([](int64_t kind, torch::Tensor packed, c10::optional<torch::Tensor> scale,
                       c10::optional<torch::Tensor> colsum, int64_t group, int64_t N, c10::optional<torch::Tensor> bias) {
             TORCH_CHECK(kind >= LinearOp::fp16 && kind <= LinearOp::int4_vnni, "unknown LinearOp kind ", kind);
             return LinearOp{kind, packed, scale ? *scale : torch::Tensor(), colsum ? *colsum : torch::Tensor(), group, N, bias};
           }),
           py::arg("kind"), py::arg("packed"), py::arg("scale") = py::none(), py::arg("colsum") = py::none(),
           py::arg("group") = 0, py::arg("N"), py::arg("bias") = py::none())
      .def("__call__", &LinearOp::operator(), py::arg("x"));
  py::class_<NormOp>(m, "NormOp", "transformers' RMSNorm with its fp32 weight; lanes 16 / 8: ATen's sum order, 0: ATen's ops")
      .def(py::init([](torch::Tensor weight, double eps, int64_t lanes) { return NormOp{weight, eps, lanes}; }),
           py::arg("weight"), py::arg("eps"), py::arg("lanes"))
      .def("__call__", &NormOp::operator(), py::arg("x"));
  py::class_<LayerOps>(m, "LayerOps", "one decoder layer's norms and linear layers as layer_step runs them")
      .def(py::init([](NormOp in_norm, std::vector<LinearOp> qkv, int64_t nq, int64_t nk, int64_t head_dim, LinearOp o_proj,
                       NormOp post_norm, std::vector<LinearOp> gate_up, LinearOp down_proj, double scaling) {
             return LayerOps{in_norm, qkv, nq, nk, head_dim, o_proj, post_norm, gate_up, down_proj, scaling};
           }),
           py::arg("in_norm"), py::arg("qkv"), py::arg("nq"), py::arg("nk"), py::arg("head_dim"), py::arg("o_proj"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("down_proj"), py::arg("scaling"));
  py::class_<DecoderOps>(m, "DecoderOps", "every decoder layer's LayerOps, in order, as decoder_step runs them")
      .def(py::init([](std::vector<LayerOps> layers) { return DecoderOps{std::move(layers)}; }), py::arg("layers"));
  m.def("decoder_step", &decoder_step, "every layer as layer_step: [h, h after each keep_after count of layers]",
        py::arg("h"), py::arg("decoder"), py::arg("k_bufs"), py::arg("v_bufs"), py::arg("starts"), py::arg("cos"),
        py::arg("sin"), py::arg("mask"), py::arg("keep_after"));
  m.def("layer_qkv", &layer_qkv, "input norm, q / k / v projections (side by side), RoPE on q and k: [q, k, v]",
        py::arg("h"), py::arg("layer"), py::arg("cos"), py::arg("sin"));
  m.def("layer_rest", &layer_rest, "attention over the cache, o_proj, residual, post norm, gated MLP, residual",
        py::arg("h"), py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("mask"), py::arg("layer"));
  m.def("layer_step", &layer_step, "the whole layer, this call's keys / values written into the cache buffers at start",
        py::arg("h"), py::arg("layer"), py::arg("k_buf"), py::arg("v_buf"), py::arg("start"), py::arg("cos"),
        py::arg("sin"), py::arg("mask"));
  m.def("isa", &isa_name, "the instruction set the kernels run on: avx512, avx2 or none");
  m.def("linear_fp16", &linear_fp16, "y = x @ W^T (+ bias), W packed fp16 [P, K, 32]", py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("linear_int8", &linear_int8, "y = (x @ Q^T) * scale (+ bias), Q packed int8 [P, K, 32]", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("n"), py::arg("bias") = py::none());
  m.def("attention", &attention, "softmax(scaling q k^T + mask) v over the cache, [B, n, H, D] out; no mask: causal",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(), py::arg("scaling") = 1.0);
  m.def("has_vnni", &has_vnni, "whether the int8 x int8 kernel (AVX-512 VNNI) runs here");
  m.def("int8_dot_isa", &int8_dot_isa, "the int4 x int8 kernel's instruction set here: avx512_vnni, avx2 or none");
  m.def("linear_int4_vnni", &linear_int4_vnni,
        "y = sx * sum_g s_g (xq . Q_g - 8 sum_g xq) (+ bias): int4 weights packed [P, K / 4, 64], activations int8 per row",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("N"), py::arg("bias") = py::none());
  m.def("linear_int8_vnni", &linear_int8_vnni, "y = (xq @ Q^T) * sx * scale (+ bias), activations quantized per row",
        py::arg("x"), py::arg("packed"), py::arg("colsum"), py::arg("scale"), py::arg("n"), py::arg("bias") = py::none());
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)); lanes 16 / 8: ATen's "
        "vector width (bitwise its result), 0: ATen's operations", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("lanes") = 0);
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::arg("gate"), py::arg("up"));
  m.def("linear_int4", &linear_int4, "y = x @ ((Q - 8) * s)^T (+ bias), Q packed int4 [P, K, 16]", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("n"), py::arg("bias") = py::none());
}
