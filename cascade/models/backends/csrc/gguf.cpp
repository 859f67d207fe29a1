// GGUF block formats read from the file's own bytes: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W
// held as the file holds it (row n: K / QK blocks of the format, in file order), each weight
// dequantized exactly as the GGUF reference does (the `gguf` package's numpy `dequantize`,
// ggml's `dequantize_row_*`: fp32 operations in the same order, no fused multiply-add), fp32
// activations and fp32 accumulation.
//
// Formats (ggml type numbers): Q4_1 (3), Q5_0 (6), Q8_0 (8), Q4_K (12), Q6_K (14): the zoo's files
// (the 1.5B's Q4_K / Q6_K, the 0.5B's Q5_0 / Q8_0 / Q6_K / Q4_K, SmolLM2's Q4_1 / Q8_0).
//
// Decoding (AVX-512): a 4-bit or 5-bit code has at most 32 values per scale, so a block's (or
// sub-block's) dequantized values are computed once as a table of 16 floats (two for Q5_0) with
// the reference's operations, and the weights are gathered from it by their codes with one
// permute per 16 weights (vpermps reads the code's low 4 bits; Q5_0's fifth bit selects the
// second table through a mask). Q6_K (64 codes per 16-weight scale) and Q8_0 convert their codes
// and multiply, as the reference does. AVX2: a block decoded 8 weights at a time (codes widened to
// 32-bit lanes, converted, then the reference's multiply and add or subtract) into a buffer, then
// multiplied; with the scalar reference decode (below) a 1.5B step took 1.6 s on an AVX2-only EPYC,
// 2% of the read bound (results/kernels/forward_cost_gguf_zen3.log).
//
// Row invariance: y[m, n] is two interleaved sequential FMA chains over k (16 lanes each on
// AVX-512, 8 on AVX2), added lane-wise, reduced in a fixed order, then + bias: the same
// operations whatever the row count, the block of rows the row falls in and the other rows. So
// row i of an M-row call is bitwise the 1-row call on row i.
//
// Error bound: the weights are exact (bitwise the reference's); the sum of K products in fp32
// has |y - x.w| <= gamma_K * sum_k |x_k w_k| (gamma_K = K u / (1 - K u), u = 2^-24).

#include "gguf_blocks.h"
#include "kernels.h"
#include "ops.h"

namespace cascade_native {

namespace {

// AVX-512 code here also converts fp16 scales with F16C (f16_hw, gguf_blocks.h): the scalar
// bit-level conversion runs once per 32-weight block in the legacy formats, on the hot path.
#define GGUF_AVX512 __attribute__((target("avx512f,f16c")))

#define GGUF_AVX2 __attribute__((target("avx2,fma,f16c")))

// 8 bytes at p widened to 8 32-bit lanes (zero-extended).
GGUF_AVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

GGUF_AVX512 inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// Each format: QK weights per block of BYTES bytes; decode() the scalar reference (the test
// oracle's twin, reading codes through gguf_blocks.h); decode_avx2() the same operations 8 lanes
// wide; on AVX-512, prepare() reads a block's scales once and group() writes the block's weights
// GW * g .. GW * (g + 1) - 1 as GW / 16 vectors.

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20, GW = 32;
  static void decode(const uint8_t* b, float* w) {  // w = d * q + m
    const float d = f16_at(b), m = f16_at(b + 2);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>(b[4 + i] & 0xF) + m;
      w[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
    }
  }
  GGUF_AVX2 static void decode_avx2(const uint8_t* b, float* w) {
    const __m256 d = _mm256_set1_ps(f16_hw(b)), m = _mm256_set1_ps(f16_hw(b + 2));
    const __m256i low4 = _mm256_set1_epi32(0xF);
    for (int h = 0; h < 2; ++h) {
      const __m256i c = bytes8(b + 4 + 8 * h);
      _mm256_storeu_ps(w + 8 * h, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(c, low4))), m));
      _mm256_storeu_ps(w + 16 + 8 * h, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4))), m));
    }
  }
  struct Prep {
    __m512 table;
  };
  GGUF_AVX512 static Prep prepare(const uint8_t* b) {
    return {_mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16_hw(b)), iota16()), _mm512_set1_ps(f16_hw(b + 2)))};
  }
  GGUF_AVX512 static void group(const uint8_t* b, const Prep& p, int, __m512* w) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    w[0] = _mm512_permutexvar_ps(codes, p.table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), p.table);
  }
};

struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22, GW = 32;
  static void decode(const uint8_t* b, float* w) {  // w = d * (q - 16), q = low nibble | high bit << 4
    const float d = f16_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[6 + i] & 0xF) | (((qh >> i) & 1) << 4), hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      w[i] = d * static_cast<float>(lo - 16);
      w[i + 16] = d * static_cast<float>(hi - 16);
    }
  }
  GGUF_AVX2 static void decode_avx2(const uint8_t* b, float* w) {
    const __m256 d = _mm256_set1_ps(f16_hw(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh)), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i one = _mm256_set1_epi32(1), low4 = _mm256_set1_epi32(0xF), sixteen = _mm256_set1_epi32(16);
    for (int h = 0; h < 2; ++h) {
      const __m256i c = bytes8(b + 6 + 8 * h);
      const __m256i lo_bit = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(iota, _mm256_set1_epi32(8 * h))), one);
      const __m256i hi_bit = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(iota, _mm256_set1_epi32(8 * h + 16))), one);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_slli_epi32(lo_bit, 4));
      const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(hi_bit, 4));
      _mm256_storeu_ps(w + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, sixteen))));
      _mm256_storeu_ps(w + 16 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, sixteen))));
    }
  }
  struct Prep {
    __m512 low, high;  // the codes 0-15 and 16-31: d * (c - 16)
    uint32_t qh;
  };
  GGUF_AVX512 static Prep prepare(const uint8_t* b) {
    const __m512 d = _mm512_set1_ps(f16_hw(b)), iota = iota16();
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    return {_mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f))), _mm512_mul_ps(d, iota), qh};
  }
  GGUF_AVX512 static void group(const uint8_t* b, const Prep& p, int, __m512* w) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6)));
    const __m512i high = _mm512_srli_epi32(codes, 4);
    w[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(codes, p.low), static_cast<__mmask16>(p.qh), codes, p.high);
    w[1] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(high, p.low), static_cast<__mmask16>(p.qh >> 16), high, p.high);
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, GW = 32;
  static void decode(const uint8_t* b, float* w) {  // w = q * d
    const float d = f16_at(b);
    for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
  }
  GGUF_AVX2 static void decode_avx2(const uint8_t* b, float* w) {
    const __m256 d = _mm256_set1_ps(f16_hw(b));
    for (int v = 0; v < 4; ++v) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v)));
      _mm256_storeu_ps(w + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
  }
  struct Prep {
    __m512 d;
  };
  GGUF_AVX512 static Prep prepare(const uint8_t* b) { return {_mm512_set1_ps(f16_hw(b))}; }
  GGUF_AVX512 static void group(const uint8_t* b, const Prep& p, int, __m512* w) {
    for (int v = 0; v < 2; ++v)
      w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v)))), p.d);
  }
};

// Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales / mins for 8 sub-blocks of 32, 128 bytes of
// codes (32 bytes per pair of sub-blocks: low nibbles the first, high nibbles the second).
struct Q4_K {
  static constexpr int QK = 256, BYTES = 144, GW = 64;
  static void decode(const uint8_t* b, float* w) {  // w = (d * sc) * q - dmin * m per sub-block
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const ScalesMins u = q4k_scales_mins(b + 4);
    for (int j = 0; j < 8; ++j) {
      const float scale = d * static_cast<float>(u.byte(j)), offset = dmin * static_cast<float>(u.byte(8 + j));
      for (int i = 0; i < 32; ++i) w[32 * j + i] = scale * static_cast<float>(q4k_code(b, 32 * j + i)) - offset;
    }
  }
  GGUF_AVX2 static void decode_avx2(const uint8_t* b, float* w) {
    const float d = f16_hw(b), dmin = f16_hw(b + 2);
    const ScalesMins u = q4k_scales_mins(b + 4);
    const __m256i low4 = _mm256_set1_epi32(0xF);
    for (int j = 0; j < 8; ++j) {
      const __m256 scale = _mm256_set1_ps(d * static_cast<float>(u.byte(j)));
      const __m256 offset = _mm256_set1_ps(dmin * static_cast<float>(u.byte(8 + j)));
      const uint8_t* q = b + 16 + 32 * (j / 2);
      for (int g = 0; g < 4; ++g) {
        const __m256i c = bytes8(q + 8 * g), code = j % 2 ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, low4);
        _mm256_storeu_ps(w + 32 * j + 8 * g, _mm256_sub_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(code)), offset));
      }
    }
  }
  // The 8 scales d * sc and 8 offsets dmin * m as one 16-lane product (llama.cpp's unpacking of
  // the 6-bit fields: sc in bytes 0-7, m in bytes 8-15 of u), each a single fp32 rounding as in
  // the reference.
  struct Prep {
    alignas(64) float scale_offset[16];
  };
  GGUF_AVX512 static Prep prepare(const uint8_t* b) {
    const ScalesMins u = q4k_scales_mins(b + 4);
    const __m128i bytes = _mm_setr_epi32(static_cast<int>(u.word[0]), static_cast<int>(u.word[1]), static_cast<int>(u.word[2]),
                                         static_cast<int>(u.word[3]));
    const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16_hw(b)), _mm512_set1_ps(f16_hw(b + 2)));
    Prep p;
    _mm512_store_ps(p.scale_offset, _mm512_mul_ps(d, fields));
    return p;
  }
  GGUF_AVX512 static void group(const uint8_t* b, const Prep& p, int g, __m512* w) {
    const __m512 iota = iota16();
    const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(p.scale_offset[2 * g]), iota), _mm512_set1_ps(p.scale_offset[8 + 2 * g]));
    const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(p.scale_offset[2 * g + 1]), iota),
                                    _mm512_set1_ps(p.scale_offset[9 + 2 * g]));
    const uint8_t* q = b + 16 + 32 * g;
    const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    w[0] = _mm512_permutexvar_ps(c0, t0);
    w[1] = _mm512_permutexvar_ps(c1, t0);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), t1);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), t1);
  }
};

// Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights), d.
// Weight h * 128 + t * 32 + i (h < 2, t < 4, i < 32): low bits from ql[64 h + 32 (t & 1) + i]
// (nibble t >> 1), high bits from qh[32 h + i] (bits 2t, 2t + 1); w = (d * scale) * (q - 32).
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, GW = 128;
  static void decode(const uint8_t* b, float* w) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int j = 0; j < 16; ++j) {
      const float scale = d * static_cast<float>(sc[j]);
      for (int i = 0; i < 16; ++i) w[16 * j + i] = scale * static_cast<float>(q6k_code(b, 16 * j + i) - 32);
    }
  }
  // Weights k = 128 h + 32 t + i, 8 at a time: q6k_code's shifts and masks on 32-bit lanes.
  GGUF_AVX2 static void decode_avx2(const uint8_t* b, float* w) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_hw(b + 208);
    const __m256i low4 = _mm256_set1_epi32(0xF), low2 = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t) {
        const __m128i low_shift = _mm_cvtsi32_si128(4 * (t >> 1)), high_shift = _mm_cvtsi32_si128(2 * t);
        for (int i = 0; i < 32; i += 8) {
          const int k = 128 * h + 32 * t + i;
          const __m256i low = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 64 * h + 32 * (t & 1) + i), low_shift), low4);
          const __m256i high = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 128 + 32 * h + i), high_shift), low2);
          const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), bias);
          _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(sc[k / 16])), _mm256_cvtepi32_ps(q)));
        }
      }
  }
  struct Prep {
    alignas(64) float scale[16];
  };
  GGUF_AVX512 static Prep prepare(const uint8_t* b) {
    Prep p;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_ps(p.scale, _mm512_mul_ps(_mm512_set1_ps(f16_hw(b + 208)), sc));
    return p;
  }
  // Half h = g: weights 128 h + 32 t + 16 v + i as w[2 t + v].
  GGUF_AVX512 static void group(const uint8_t* b, const Prep& p, int h, __m512* w) {
    const __m512i low4 = _mm512_set1_epi32(0xF), bits45 = _mm512_set1_epi32(0x30);
    const __m512 bias = _mm512_set1_ps(32.0f);
    for (int v = 0; v < 2; ++v) {
      const __m512i qh = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * h + 16 * v)));
      const __m512i high[4] = {_mm512_slli_epi32(qh, 4), _mm512_slli_epi32(qh, 2), qh, _mm512_srli_epi32(qh, 2)};
      for (int half = 0; half < 2; ++half) {  // t = half (low nibbles), t = half + 2 (high nibbles) share ql's bytes
        const __m512i ql = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * h + 32 * half + 16 * v)));
        const __m512i lows[2] = {_mm512_and_si512(ql, low4), _mm512_srli_epi32(ql, 4)};
        for (int nib = 0; nib < 2; ++nib) {
          const int t = half + 2 * nib;
          // q = low | (high & 0x30): vpternlogd with the mask (A | (B & C))
          const __m512i q = _mm512_ternarylogic_epi32(lows[nib], high[t], bits45, 0xF8);
          w[2 * t + v] = _mm512_mul_ps(_mm512_set1_ps(p.scale[8 * h + 2 * t + v]), _mm512_sub_ps(_mm512_cvtepi32_ps(q), bias));
        }
      }
    }
  }
};

// NR output rows (weight rows w + r * row_bytes) times MR input rows: acc[r][m][v & 1] += w_v * x_v
// in k order; y[m][n] = reduce(acc[r][m][0] + acc[r][m][1]) (+ bias).
template <typename F, int NR, int MR>
GGUF_AVX512 void gguf_rows_avx512(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                                                          int64_t K, const float* bias, float* y, int64_t ldy) {
  constexpr int V = F::GW / 16;
  __m512 acc[NR][MR][2];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / F::QK; ++blk) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* b = w + r * row_bytes + blk * F::BYTES;
      for (int line = 0; line < F::BYTES; line += 64) prefetch_ahead(b + line);
      const typename F::Prep p = F::prepare(b);
      for (int g = 0; g < F::QK / F::GW; ++g) {
        __m512 wv[V];
        F::group(b, p, g, wv);
        const float* xk = x + blk * F::QK + g * F::GW;
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < V; ++v) acc[r][m][v & 1] = _mm512_fmadd_ps(wv[v], _mm512_loadu_ps(xk + m * ldx + 16 * v), acc[r][m][v & 1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
      y[m * ldy + r] = bias ? s + bias[r] : s;
    }
}

// AVX2: each block decoded into a buffer (decode_avx2), then 8-lane FMA chains.
template <typename F, int MR>
GGUF_AVX2 void gguf_rows_avx2(const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* bias, float* y,
                              int64_t ldy) {
  alignas(64) float buf[F::QK];
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / F::QK; ++blk) {
    prefetch_ahead(w + blk * F::BYTES);
    F::decode_avx2(w + blk * F::BYTES, buf);
    const float* xk = x + blk * F::QK;
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < F::QK; i += 16) {
        acc[m][0] = _mm256_fmadd_ps(_mm256_load_ps(buf + i), _mm256_loadu_ps(xk + m * ldx + i), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_load_ps(buf + i + 8), _mm256_loadu_ps(xk + m * ldx + i + 8), acc[m][1]);
      }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc[m][0], acc[m][1]));
    const float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    y[m * ldy] = bias ? s + bias[0] : s;
  }
}

// One block's weights as the AVX-512 kernel decodes them (the weights the kernel multiplies).
template <typename F>
GGUF_AVX512 void decode_avx512(const uint8_t* b, float* dst) {
  const typename F::Prep p = F::prepare(b);
  for (int g = 0; g < F::QK / F::GW; ++g) {
    __m512 wv[F::GW / 16];
    F::group(b, p, g, wv);
    for (int v = 0; v < F::GW / 16; ++v) _mm512_storeu_ps(dst + g * F::GW + 16 * v, wv[v]);
  }
}

// Input rows per block: on AVX-512 up to 8 (a decoded weight group feeds them all: with 4 the
// decode takes as many instructions as the FMAs), 4 for Q6_K (its group is 8 weight vectors,
// beside which more rows' accumulators do not fit the registers); an M-row call in balanced
// blocks (13 -> 7 + 6). AVX2: 4. Timings per layer and row count: experiments/gguf_layers.py.
constexpr int GGUF_MR_AVX2 = 4;
template <typename F>
constexpr int gguf_mr() { return F::GW > 64 ? 4 : 8; }

// The paths: AVX-512 and AVX2 kernels (both from a block's bytes, the same weights bitwise; the
// sums' lane counts differ, so their bits differ), and the scalar decode (dequantize_gguf only).
enum class GgufPath { avx512, avx2, scalar };

// "auto" is this CPU's fastest (the scalar decode without AVX2); a named path this CPU cannot run
// is an error.
GgufPath gguf_path_named(const char* op, const std::string& name, bool scalar_allowed) {
  if (name == "auto") return isa() == Isa::avx512 ? GgufPath::avx512 : isa() == Isa::avx2 ? GgufPath::avx2 : GgufPath::scalar;
  TORCH_CHECK(name == "avx512" || name == "avx2" || (scalar_allowed && name == "scalar"), op, ": unknown path '", name,
              "' (auto, avx512, avx2", scalar_allowed ? ", scalar)" : ")");
  const GgufPath path = name == "avx512" ? GgufPath::avx512 : name == "avx2" ? GgufPath::avx2 : GgufPath::scalar;
  TORCH_CHECK(path != GgufPath::avx512 || isa() == Isa::avx512, op, ": this CPU has no AVX-512");
  TORCH_CHECK(path != GgufPath::avx2 || isa() != Isa::none, op, ": this CPU has no AVX2");
  return path;
}

// Output rows n0 .. n1 - 1 of an M-row call: on AVX-512 four output rows side by side for one
// input row (8 FMA chains), two for two to four, one from five (>= 8 chains each).
template <typename F>
void gguf_range(const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t K, const float* bias,
                float* y, int64_t N, int64_t n0, int64_t n1, GgufPath path) {
  if (path == GgufPath::avx512) {
    constexpr int MRMAX = gguf_mr<F>();
    const int64_t blocks = (M + MRMAX - 1) / MRMAX, mr = (M + blocks - 1) / blocks;
    run_rows(M, static_cast<int>(mr), [&](int64_t r0, int rows) {
      with_rows<MRMAX>(rows, [&](auto r) {
        constexpr int MR = decltype(r)::value, NR = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
        int64_t n = n0;
        for (; n + NR <= n1; n += NR)
          gguf_rows_avx512<F, NR, MR>(x + r0 * ldx, ldx, w + n * row_bytes, row_bytes, K, bias ? bias + n : nullptr,
                                      y + r0 * N + n, N);
        for (; n < n1; ++n)
          gguf_rows_avx512<F, 1, MR>(x + r0 * ldx, ldx, w + n * row_bytes, row_bytes, K, bias ? bias + n : nullptr,
                                     y + r0 * N + n, N);
      });
    });
    return;
  }
  run_rows(M, GGUF_MR_AVX2, [&](int64_t r0, int rows) {
    with_rows<GGUF_MR_AVX2>(rows, [&](auto r) {
      for (int64_t n = n0; n < n1; ++n)
        gguf_rows_avx2<F, decltype(r)::value>(x + r0 * ldx, ldx, w + n * row_bytes, K, bias ? bias + n : nullptr,
                                              y + r0 * N + n, N);
    });
  });
}

// fn(F{}) for the format numbered qtype (ggml's numbering); other types are an error naming them.
template <typename Fn>
auto with_format(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case 3: return fn(Q4_1{});
    case 6: return fn(Q5_0{});
    case 8: return fn(Q8_0{});
    case 12: return fn(Q4_K{});
    case 14: return fn(Q6_K{});
  }
  TORCH_CHECK(false, "GGUF block type ", qtype, " has no native kernel (supported: Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
}

template <typename F>
void check_blocks(const char* op, const torch::Tensor& blocks, int64_t K) {
  expect(blocks, op, "blocks", torch::kUInt8, Layout::contiguous);
  TORCH_CHECK(blocks.dim() == 2, op, ": blocks must be 2-D [rows, row bytes]");
  TORCH_CHECK(K > 0 && K % F::QK == 0, op, ": K = ", K, " is not a whole number of ", F::QK, "-weight blocks");
  TORCH_CHECK(blocks.size(1) == K / F::QK * F::BYTES, op, ": a row of K = ", K, " weights is ", K / F::QK * F::BYTES,
              " bytes, blocks has ", blocks.size(1));
}

}  // namespace

int64_t gguf_block_weights(int64_t qtype) {
  return with_format(qtype, [](auto f) -> int64_t { return decltype(f)::QK; });
}

int64_t gguf_block_bytes(int64_t qtype) {
  return with_format(qtype, [](auto f) -> int64_t { return decltype(f)::BYTES; });
}

torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias, const std::string& path) {
  TORCH_CHECK(isa() != Isa::none, "cascade native kernels need AVX2 + FMA + F16C or AVX-512");
  const GgufPath which = gguf_path_named("linear_gguf", path, false);
  expect(x, "linear_gguf", "x", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(x.dim() == 2, "linear_gguf: x must be 2-D [M, K]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == N, "linear_gguf: blocks must be [N, row bytes] with N = ", N);
  expect_bias(bias, "linear_gguf", N);
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  with_format(qtype, [&](auto f) {
    using F = decltype(f);
    check_blocks<F>("linear_gguf", blocks, K);
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t row_bytes = blocks.size(1);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gguf_range<F>(xp, ldx, M, wp, row_bytes, K, bp, yp, N, n0, n1, which); });
  });
  return y;
}

torch::Tensor dequantize_gguf(const torch::Tensor& blocks, int64_t qtype, int64_t K, const c10::optional<torch::Tensor>& rows,
                              const std::string& path) {
  const GgufPath which = gguf_path_named("dequantize_gguf", path, true);
  return with_format(qtype, [&](auto f) {
    using F = decltype(f);
    check_blocks<F>("dequantize_gguf", blocks, K);
    torch::Tensor index = rows ? *rows : torch::arange(blocks.size(0), torch::kInt64);
    expect(index, "dequantize_gguf", "rows", torch::kInt64, Layout::contiguous);
    TORCH_CHECK(index.numel() == 0 || (index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < blocks.size(0)),
                "dequantize_gguf: a row index is outside 0 .. ", blocks.size(0) - 1);
    auto out = torch::empty({index.numel(), K}, torch::kFloat32);
    const int64_t* ip = index.data_ptr<int64_t>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    const int64_t row_bytes = blocks.size(1);
    at::parallel_for(0, index.numel(), 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t blk = 0; blk < K / F::QK; ++blk) {
          const uint8_t* b = wp + ip[r] * row_bytes + blk * F::BYTES;
          float* dst = op + r * K + blk * F::QK;
          if (which == GgufPath::avx512) decode_avx512<F>(b, dst);
          else if (which == GgufPath::avx2) F::decode_avx2(b, dst);
          else F::decode(b, dst);
        }
    });
    return out;
  });
}

}  // namespace cascade_native
