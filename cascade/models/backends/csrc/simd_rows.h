// Register-blocked row kernels over packed weight panels: AVX-512 and AVX2 + F16C + FMA (fp16,
// int8 and int4 weights times fp32 rows, one sequential FMA chain per output element), and the
// store / mask helpers the int8-activation kernels (int8_dot.cpp) share.
#pragma once

#include "kernels.h"

namespace cascade_native {

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

// 16 weights of a panel row as fp32: fp16 (F16C) or int8 (sign-extended, converted).
template <typename WT>
__attribute__((target("avx512f"))) inline __m512 load16_avx512(const WT* w) {
  if constexpr (sizeof(WT) == 2) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  else return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// fp16 and int8 weights (WT: the stored type) times MR fp32 rows over PP panels (side by side in
// memory, pstride elements apart): acc[q][m][0..1] hold columns 0-15 and 16-31 of panel q, row m.
// Each output element is one sequential FMA chain over k; PP > 1 only gives one or two rows
// enough independent chains to hide the FMA latency (with 2 accumulators a 1-row pass waits on
// each FMA's result), so the result does not depend on PP. Only the last panel of a pass may be
// partial (ncols valid columns). int8: one scale per output column, y = (sum_k x_k q_k) * scale
// (+ bias); fp16: scale is null.
template <int MR, int PP, typename WT>
__attribute__((target("avx512f"))) void rows_avx512(const float* x, int64_t ldx, const WT* panel, int64_t pstride,
                                                     int64_t K, const float* scale, const float* bias, float* y,
                                                     int64_t ldy, int ncols) {
  __m512 acc[PP][MR][2];
  for (int q = 0; q < PP; ++q)
    for (int m = 0; m < MR; ++m) acc[q][m][0] = acc[q][m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[PP][2];
    for (int q = 0; q < PP; ++q) {
      const WT* wk = panel + q * pstride + k * NC;
      prefetch_ahead(wk);
      w[q][0] = load16_avx512(wk);
      w[q][1] = load16_avx512(wk + 16);
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
    for (int m = 0; m < MR; ++m) {
      __m512 a0 = acc[q][m][0], a1 = acc[q][m][1];
      if (scale) {
        a0 = _mm512_mul_ps(a0, _mm512_maskz_loadu_ps(pm.low, scale + q * NC));
        a1 = _mm512_mul_ps(a1, _mm512_maskz_loadu_ps(pm.high, scale + q * NC + 16));
      }
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


}  // namespace cascade_native
