// int8 activations times int8 or int4 weights with integer sums (AVX-512 VNNI; int4 also AVX2): drafters' kernels.

#include "kernels.h"
#include "simd_rows.h"
#include "ops.h"

namespace cascade_native {

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


}  // namespace cascade_native
