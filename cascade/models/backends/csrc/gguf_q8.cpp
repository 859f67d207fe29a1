// GGUF k-quant blocks times int8 activations: llama.cpp's kind of arithmetic (its CPU backend
// quantizes activations to Q8_K for k-quant dot products), row-invariant and defined exactly so
// that an independent integer reference reproduces every output bit (tests/test_gguf.py).
//
// Activations: each row's 256-weight blocks quantized on their own: amax = max |x|, dx = amax /
// 127, xq = rint(x * (127 / amax)) (round half to even; all zero when amax is 0; NaN inputs not
// defined), and the sums of xq over each 16 (bs16). Per output row n, input row m and block b,
// integer sums (exact, so their order is free):
//   Q4_K: I = sum_j sc_j sum_{i<32} q xq,  Mn = sum_j m_j (bs16[2j] + bs16[2j+1]),
//         y_b = (d dx) float(I) - (dmin dx) float(Mn)
//   Q6_K: I = sum_j sc_j (sum_{i<16} q xq - 32 bs16[j]),  y_b = (d dx) float(I)
// every product and difference one fp32 operation in that order (no fused multiply-add); y =
// y_0 + y_1 + ... in block order (+ bias). Nothing depends on the other rows: row i of an M-row
// call is bitwise the 1-row call.
//
// AVX-512 VNNI: codes unpacked 64 per vector, vpmaddubsw against the activations (pairs of
// products in 16 bits) and vpdpwssd against the sub-block scales (accumulated in 32 bits; Q6_K's
// -32 offset as vpdpwssd of bs16 against -32 sc_j, |-32 sc_j| <= 4096), in tiles of 4 output rows
// x up to 8 input rows whose block sums are reduced and scaled in lanes (q8_tile). AVX2:
// 32 codes per vector (one Q4_K sub-block, two Q6_K ones), vpmaddubsw, then vpmaddwd against the
// scales and a 32-bit add, each output row's block sums for up to 8 input rows reduced and scaled
// in lanes (q8_rows_avx2): the same integers (no pair sum or product can overflow: codes <= 63,
// |xq| <= 127, scales <= 127). Elsewhere the same integers in scalar code. Other block types have
// no int8 path (the backend keeps them on the exact kernel, gguf.cpp).

#include "gguf_blocks.h"
#include "kernels.h"
#include "ops.h"

namespace cascade_native {

namespace {

constexpr int QK = 256;

// Each row's blocks quantized: q [M, K] (Q4_K: each block's 32-weight pieces in the order its
// code vectors hold them), d [K / 256, M], bs16 [M, K / 16], bs32 [K / 256, M, 8] (each block's
// sums of 32, natural order: at most 32 x 127, so 16 bits hold them). d and bs32 are block-major
// (a tile's input rows side by side), with 8 more rows of zeros so that a tile's 8-row loads at
// the last rows stay inside.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bs16, bs32;
  int64_t M, K;

  // row m's block b: its 256 int8 values, its scale dx, its 16 sums of 16 and 8 sums of 32
  const int8_t* q_at(int64_t m, int64_t b) const { return q.data() + m * K + b * QK; }
  const float* ds_at(int64_t m, int64_t b) const { return d.data() + b * M + m; }  // input rows m, m + 1, ... side by side
  float d_at(int64_t m, int64_t b) const { return *ds_at(m, b); }
  const int16_t* bs_at(int64_t m, int64_t b) const { return bs16.data() + m * (K / 16) + b * 16; }
  const int16_t* bs32_at(int64_t m, int64_t b) const { return bs32.data() + (b * M + m) * 8; }
};

// Output row r's block b of a tile of NR rows, and what lies PREFETCH_BYTES further along the
// tile's walk (block b of each row, then b + 1, ...; past a row's end, the next tile's same row)
// prefetched. A fixed distance within the row fell inside the tile's own rows when rows are long
// (ffn_down's 7,350 bytes), and the next tile came from memory unprefetched.
// Into L2 (T1), not L1: a stream of T0 prefetches holds the core's few L1 miss buffers until
// their lines arrive, and the one-row calls (little arithmetic per byte) waited on them: the
// 1.5B's 1-token forward 56 -> 28 ms on a Zen 4 EPYC (results/kernels/forward_cost_prefetch_zen4.log;
// docs/backends.md, "gguf_q8's prefetches").
// -DCASCADE_GGUF_PREFETCH_HINT overrides it for experiments.
#ifndef CASCADE_GGUF_PREFETCH_HINT
#define CASCADE_GGUF_PREFETCH_HINT _MM_HINT_T1
#endif
inline void prefetch_to_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), CASCADE_GGUF_PREFETCH_HINT); }

template <int NR>
inline const uint8_t* block_at(const uint8_t* w, int r, int64_t row_bytes, int64_t b, int block_bytes) {
  const uint8_t* blk = w + r * row_bytes + b * block_bytes;
  const int64_t nb = row_bytes / block_bytes, p = b + std::max<int64_t>(1, PREFETCH_BYTES / (NR * block_bytes));
  const uint8_t* ahead = w + (r + p / nb * NR) * row_bytes + (p % nb) * block_bytes;
  for (int line = 0; line < block_bytes; line += 64) prefetch_to_l2(ahead + line);
  return blk;
}

// Q4_K's code vectors (64 bytes each) hold the sub-blocks (0, 2), (1, 3), (4, 6), (5, 7): the low
// and high nibbles of two 32-byte chunks.
constexpr int Q4K_PIECE[8] = {0, 2, 1, 3, 4, 6, 5, 7};

// One 256-value block to int8 codes and its scale dx (the header's rule). The scalar code is the
// definition; the AVX-512 one the same operations per lane (a max is exact in any order; the
// product one fp32 multiply; vcvtps2dq rounds half to even as nearbyint does in the default mode),
// without the scalar loop's libm call per value.
// The VNNI path uses the AVX-512 one, the AVX2 and scalar paths the scalar one (what an AVX2-only
// CPU runs, so that their tests on an AVX-512 CPU check it too).
float block_codes_scalar(const float* xb, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  if (amax == 0.0f) {
    std::memset(q, 0, QK);
    return 0.0f;
  }
  const float inv = 127.0f / amax;
  for (int i = 0; i < QK; ++i) q[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(xb[i] * inv))));
  return amax / 127.0f;
}

__attribute__((target("avx512f,avx512bw"))) float block_codes_avx512(const float* xb, int8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < QK; i += 16) amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), amax);  // a NaN is skipped, as std::max skips it
  const float a = _mm512_reduce_max_ps(amax);
  if (a == 0.0f) {
    std::memset(q, 0, QK);
    return 0.0f;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / a);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int i = 0; i < QK; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_max_epi32(lo, _mm512_min_epi32(hi, v))));
  }
  return a / 127.0f;
}

QuantizedRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, bool q4k_order, bool avx512) {
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / QK) + 8), std::vector<int16_t>(M * (K / 16)),
                  std::vector<int16_t>((M * (K / QK) + 8) * 8), M, K};
  const auto block_codes = avx512 ? block_codes_avx512 : block_codes_scalar;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / QK; ++b) {
      int8_t q[QK];
      r.d[b * M + m] = block_codes(x + m * ldx + b * QK, q);
      int16_t* bs16 = r.bs16.data() + m * (K / 16) + b * 16;
      for (int s = 0; s < 16; ++s) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * s + i];
        bs16[s] = static_cast<int16_t>(sum);
      }
      for (int j = 0; j < 8; ++j) r.bs32[(b * M + m) * 8 + j] = static_cast<int16_t>(bs16[2 * j] + bs16[2 * j + 1]);
      int8_t* dst = r.q.data() + m * K + b * QK;
      for (int p = 0; p < 8; ++p) std::memcpy(dst + 32 * p, q + 32 * (q4k_order ? Q4K_PIECE[p] : p), 32);
    }
  return r;
}

// ---- the fp32 epilogue, every path's -------------------------------------------------------------

// A block's value from its integer sums: each product and the difference one fp32 operation, in
// this order (the header's definition).
inline float q4k_value(float d, float dmin, float dx, int64_t I, int64_t Mn) {
  const float dd = d * dx, dm = dmin * dx;
  const float t1 = dd * static_cast<float>(I), t2 = dm * static_cast<float>(Mn);
  return t1 - t2;
}

inline float q6k_value(float d, float dx, int64_t I) {
  const float dd = d * dx;
  return dd * static_cast<float>(I);
}

// ---- the scalar path (and the definition) ------------------------------------------------------

float q4k_block_scalar(const uint8_t* b, const int8_t* xq, float dx, const int16_t* bs16) {
  const ScalesMins u = q4k_scales_mins(b + 4);
  int64_t I = 0, Mn = 0;
  for (int p = 0; p < 8; ++p) {  // piece p of xq is sub-block Q4K_PIECE[p]
    const int j = Q4K_PIECE[p];
    int64_t dot = 0;
    for (int i = 0; i < 32; ++i) dot += q4k_code(b, 32 * j + i) * xq[32 * p + i];
    I += u.byte(j) * dot;
    Mn += u.byte(8 + j) * (bs16[2 * j] + bs16[2 * j + 1]);
  }
  return q4k_value(f16_at(b), f16_at(b + 2), dx, I, Mn);
}

float q6k_block_scalar(const uint8_t* b, const int8_t* xq, float dx, const int16_t* bs16) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  int64_t I = 0;
  for (int j = 0; j < 16; ++j) {
    int64_t dot = 0;
    for (int i = 0; i < 16; ++i) dot += q6k_code(b, 16 * j + i) * xq[16 * j + i];
    I += sc[j] * (dot - 32 * bs16[j]);
  }
  return q6k_value(f16_at(b + 208), dx, I);
}

// ---- AVX-512 VNNI -------------------------------------------------------------------------------

#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// The four 64-weight code vectors of a block and its scales (16-bit lanes matching the codes'
// 16-bit product pairs), and per format what the block needs besides.
struct Q4KCodes {
  __m512i codes[4], scales[4];
};

// Index vectors for vpermw: lanes 8q .. 8q + 7 take value pieces[q] (a 16-bit lane is a pair of
// codes: 8 lanes are 16 weights).
struct LaneIndex {
  alignas(64) int16_t lane[32];
};
constexpr LaneIndex lane_index(int a, int b, int c, int d) {
  LaneIndex index{};
  const int pieces[4] = {a, b, c, d};
  for (int l = 0; l < 32; ++l) index.lane[l] = static_cast<int16_t>(pieces[l / 8]);
  return index;
}
// Q4_K: the code vectors hold sub-blocks (0, 2), (1, 3), (4, 6), (5, 7), 32 weights each
constexpr LaneIndex Q4K_LANES[4] = {lane_index(0, 0, 2, 2), lane_index(1, 1, 3, 3), lane_index(4, 4, 6, 6), lane_index(5, 5, 7, 7)};
// the same from the upper half of a pair of blocks' 16-bit scales (q8_tile's odd rows)
constexpr LaneIndex Q4K_LANES_HIGH[4] = {lane_index(16, 16, 18, 18), lane_index(17, 17, 19, 19), lane_index(20, 20, 22, 22),
                                         lane_index(21, 21, 23, 23)};
// Q6_K: vector v holds its sub-blocks 4v .. 4v + 3, 16 weights each
constexpr LaneIndex Q6K_LANES[4] = {lane_index(0, 1, 2, 3), lane_index(4, 5, 6, 7), lane_index(8, 9, 10, 11), lane_index(12, 13, 14, 15)};

Q8_TARGET inline __m512i lanes_of(const __m256i& values16, const LaneIndex& index) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(index.lane), _mm512_castsi256_si512(values16));
}

// Q4_K's 6-bit scales and mins of up to four blocks at once, as q4k_scales_mins unpacks one: chunk r
// of raw holds block r's 12 bytes (and 4 more), chunk r of the result its sc_0..7, m_0..7 (bytes).
Q8_TARGET inline __m512i q4k_scales_mins4(__m512i raw) {
  const __m512i a = _mm512_srlv_epi32(_mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0x98)),  // u0, u2, u1, u2 >> 4
                                      _mm512_set4_epi32(4, 0, 0, 0));
  const __m512i b = _mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0x50));  // u0, u0, u1, u1
  const __m512i even = _mm512_and_si512(a, _mm512_set1_epi32(0x3f3f3f3f));
  const __m512i odd = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0x0f0f0f0f)),
                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 6), _mm512_set1_epi32(0x03030303)), 4));
  return _mm512_mask_blend_epi32(0xAAAA, even, odd);
}

// A block's codes, and its scales from two blocks' unpacked scales and mins as 16-bit (sc_0..7,
// m_0..7 of one block, then the other's): the second block's when high.
Q8_TARGET inline Q4KCodes q4k_codes(const uint8_t* b, const __m512i& pair_scales16, bool high) {
  Q4KCodes c;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(b + 16 + 64 * h);
    c.codes[2 * h] = _mm512_and_si512(v, low4);
    c.codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  const LaneIndex* lanes = high ? Q4K_LANES_HIGH : Q4K_LANES;
  for (int v = 0; v < 4; ++v) c.scales[v] = _mm512_permutexvar_epi16(_mm512_load_si512(lanes[v].lane), pair_scales16);
  return c;
}

struct Q6KCodes {
  __m512i codes[4], scales[4];
  __m256i sc16;  // the 16 scales as 16-bit
};

Q8_TARGET inline Q6KCodes q6k_codes(const uint8_t* b) {
  Q6KCodes c;
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i qh01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i qh23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)), _mm256_srli_epi16(qh, 6), 1);
    c.codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(qh01, low2), 4));
    c.codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                         _mm512_slli_epi16(_mm512_and_si512(qh23, low2), 4));
  }
  c.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  for (int v = 0; v < 4; ++v) c.scales[v] = lanes_of(c.sc16, Q6K_LANES[v]);
  return c;
}

// ---- AVX2 ----------------------------------------------------------------------------------------

#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))

// A block's eight 32-code vectors (vector i pairs with xq + 32 i) and their scales as 16-bit lanes.
struct Codes32 {
  __m256i codes[8], scales[8];
};

Q8_AVX2 inline Codes32 q4k_codes32(const uint8_t* b, const ScalesMins& u) {
  Codes32 c;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {  // chunk i: low nibbles sub-block 2i, high 2i + 1, pieces lo and hi of xq
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * i));
    const int lo = 4 * (i / 2) + i % 2, hi = lo + 2;  // the inverse of Q4K_PIECE
    c.codes[lo] = _mm256_and_si256(v, low4);
    c.codes[hi] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  for (int i = 0; i < 8; ++i) c.scales[i] = _mm256_set1_epi16(static_cast<int16_t>(u.byte(Q4K_PIECE[i])));
  return c;
}

// Q6_K's two high bits of 32 codes (bits shift .. shift + 1 of each qh byte), moved to bits 4-5.
Q8_AVX2 inline __m256i q6k_high_bits(__m256i qh, int shift) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x03)), 4);
}

Q8_AVX2 inline Codes32 q6k_codes32(const uint8_t* b) {
  Codes32 c;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {  // weights 128 h .. 128 h + 127: vectors 4 h .. 4 h + 3
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    c.codes[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low4), q6k_high_bits(qh, 0));
    c.codes[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), q6k_high_bits(qh, 2));
    c.codes[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), q6k_high_bits(qh, 4));
    c.codes[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), q6k_high_bits(qh, 6));
  }
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int i = 0; i < 8; ++i)
    c.scales[i] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * i]), _mm_set1_epi16(sc[2 * i + 1]));
  return c;
}

// Q6_K's -32 offset as 16-bit products with bs16: -32 sc_j (|-32 sc_j| <= 4096).
Q8_AVX2 inline __m256i q6k_offsets(const uint8_t* b) {
  return _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))), _mm256_set1_epi16(-32));
}

// Q4_K's eight mins (bytes 8 .. 15 of u) as 16-bit.
Q8_AVX2 inline __m128i q4k_mins16(const ScalesMins& u) {
  return _mm_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(u.word[2]), static_cast<int>(u.word[3]), 0, 0));
}

// The block's integer dot products of one output row with one input row, in 8 lanes.
Q8_AVX2 inline __m256i codes_lanes32(const Codes32& c, const int8_t* xq) {
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // two chains: half the latency
  for (int i = 0; i < 8; ++i) {
    const __m256i pairs = _mm256_maddubs_epi16(c.codes[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i)));
    acc[i % 2] = _mm256_add_epi32(acc[i % 2], _mm256_madd_epi16(pairs, c.scales[i]));
  }
  return _mm256_add_epi32(acc[0], acc[1]);
}

// Q6_K: the dot products with the -32 offset folded in, sum_j (-32 sc_j) bs16[j] in 16-bit products.
Q8_AVX2 inline __m256i q6k_lanes32(const Codes32& c, __m256i offsets, const int8_t* xq, const int16_t* bs16) {
  return _mm256_add_epi32(codes_lanes32(c, xq), _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs16)), offsets));
}

// q4k_value / q6k_value in 8 lanes: each lane the same fp32 operations in the same order.
Q8_AVX2 inline __m256 q4k_value8(__m256 d, __m256 dmin, __m256 dx, __m256i I, __m256i Mn) {
  return _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(I)), _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(Mn)));
}

Q8_AVX2 inline __m256 q6k_value8(__m256 d, __m256 dx, __m256i I) { return _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(I)); }

// lane k = the sum of v[k]'s eight lanes (integers: exact in any order): pairwise within 128-bit
// halves, then the halves.
Q8_AVX2 inline __m256i sum_lanes8(const __m256i (&v)[8]) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));  // per half: v0 .. v3's
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));  // per half: v4 .. v7's
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// lane k = the sum of item k's four partial sums, item 2 i in lanes 0-3 of v[i] and 2 i + 1 in
// lanes 4-7 (Q4_K's Mn: eight mins times eight sums of 32 in 16-bit pairs, two items per vector).
Q8_AVX2 inline __m256i sum_quads8(const __m256i (&v)[4]) {
  // per half: items 0, 2, 4, 6 (low), 1, 3, 5, 7 (high)
  const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One input row against NR (<= 4) output rows: the rows' block sums reduced together (lane r).
template <int NR, bool Q4K>
Q8_AVX2 void q8_row_avx2(const QuantizedRows& xr, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                         float* y) {
  static_assert(NR <= 4, "at most 4 output rows");
  __m256 acc = _mm256_setzero_ps();  // lane r
  for (int64_t b = 0; b < xr.K / QK; ++b) {
    __m256i dots[8], mins[4];  // mins[i]: rows 2 i, 2 i + 1's mins (16-bit) in the low and high halves
    for (auto& v : dots) v = _mm256_setzero_si256();
    for (auto& v : mins) v = _mm256_setzero_si256();
    alignas(32) float d[8] = {}, dmin[8] = {};
    const int8_t* xq = xr.q_at(m0, b);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = block_at<NR>(w, r, row_bytes, b, Q4K ? 144 : 210);
      if constexpr (Q4K) {
        const ScalesMins u = q4k_scales_mins(blk + 4);
        dots[r] = codes_lanes32(q4k_codes32(blk, u), xq);
        const __m128i mins16 = q4k_mins16(u);
        mins[r / 2] = r % 2 ? _mm256_inserti128_si256(mins[r / 2], mins16, 1) : _mm256_inserti128_si256(mins[r / 2], mins16, 0);
        d[r] = f16_hw(blk);
        dmin[r] = f16_hw(blk + 2);
      } else {
        dots[r] = q6k_lanes32(q6k_codes32(blk), q6k_offsets(blk), xq, xr.bs_at(m0, b));
        d[r] = f16_hw(blk + 208);
      }
    }
    const __m256 dx = _mm256_set1_ps(xr.d_at(m0, b));
    if constexpr (Q4K) {
      const __m256i sums32 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr.bs32_at(m0, b))));
      __m256i mn[4];
      for (int i = 0; i < 4; ++i) mn[i] = _mm256_madd_epi16(mins[i], sums32);
      acc = _mm256_add_ps(acc, q4k_value8(_mm256_load_ps(d), _mm256_load_ps(dmin), dx, sum_lanes8(dots), sum_quads8(mn)));
    } else {
      acc = _mm256_add_ps(acc, q6k_value8(_mm256_load_ps(d), dx, sum_lanes8(dots)));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int r = 0; r < NR; ++r) y[r] = bias ? lanes[r] + bias[r] : lanes[r];
}

// NR output rows x MR (<= 8) input rows: each output row's MR block sums reduced together (lane m)
// and its epilogue run in those lanes (q4k_value8 / q6k_value8). Per pair, reducing on its own with
// a scalar epilogue took ~6 instructions a block more (by count).
template <int NR, int MR, bool Q4K>
Q8_AVX2 void q8_rows_avx2(const QuantizedRows& xr, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                          float* y, int64_t ldy) {
  static_assert(MR <= 8, "at most 8 input rows");
  __m256 acc[NR];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < xr.K / QK; ++b) {
    const __m256 dxs = _mm256_loadu_ps(xr.ds_at(m0, b));  // lane m: input row m0 + m's scale
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = block_at<NR>(w, r, row_bytes, b, Q4K ? 144 : 210);
      __m256i dots[8];
      for (auto& v : dots) v = _mm256_setzero_si256();
      __m256 value;
      if constexpr (Q4K) {
        const ScalesMins u = q4k_scales_mins(blk + 4);
        const Codes32 c = q4k_codes32(blk, u);
        for (int m = 0; m < MR; ++m) dots[m] = codes_lanes32(c, xr.q_at(m0 + m, b));
        const __m256i mins = _mm256_broadcastsi128_si256(q4k_mins16(u));
        __m256i mn[4];  // mn[i]: input rows m0 + 2 i, m0 + 2 i + 1's sums of 32 times the mins
        for (int i = 0; i < 4; ++i) mn[i] = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.bs32_at(m0 + 2 * i, b))), mins);
        value = q4k_value8(_mm256_set1_ps(f16_hw(blk)), _mm256_set1_ps(f16_hw(blk + 2)), dxs, sum_lanes8(dots), sum_quads8(mn));
      } else {
        const Codes32 c = q6k_codes32(blk);
        const __m256i offsets = q6k_offsets(blk);
        for (int m = 0; m < MR; ++m) dots[m] = q6k_lanes32(c, offsets, xr.q_at(m0 + m, b), xr.bs_at(m0 + m, b));
        value = q6k_value8(_mm256_set1_ps(f16_hw(blk + 208)), dxs, sum_lanes8(dots));
      }
      acc[r] = _mm256_add_ps(acc[r], value);
    }
  }
  for (int r = 0; r < NR; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = bias ? lanes[m] + bias[r] : lanes[m];
  }
}

// The VNNI path: a tile of up to 4 output rows x 8 input rows (one input row: a decode step) whose
// block sums are reduced together, four input rows to a vector (lane 4 r + m), and whose epilogue
// runs in those lanes: each lane the same fp32 operations in the same order as the scalar path's
// (q4k_value16 / q6k_value16), so the same bits. Reducing each pair's vector on its own, with a
// scalar epilogue, took ~30 instructions a block per pair against ~8 here (by count): the 1.5B's
// FFN gate at 8 input rows 0.84 ms before, 0.37 after on the Zen 5 (experiments/gguf_layers.py;
// results/kernels/gguf_layers_q8_paths_zen5.log, gguf_layers_q8_tiles_zen5.log).

// lane 4 c + p = the sum of chunk c (four 32-bit lanes) of v[p] (integers: exact in any order).
Q8_TARGET inline __m512i sum_chunks4(const __m512i (&v)[4]) {
  const __m512i s0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i s1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s0, s1), _mm512_unpackhi_epi64(s0, s1));
}

// lane 4 q + p = the sum of lane p over the four chunks of v[q].
Q8_TARGET inline __m512i sum_across_chunks(const __m512i (&v)[4]) {
  // 0x88: chunks 0, 2 of each operand; 0xDD: chunks 1, 3
  const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x88), _mm512_shuffle_i32x4(v[0], v[1], 0xDD));
  const __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x88), _mm512_shuffle_i32x4(v[2], v[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

// lane 4 r = the sum of v[r]'s 16 lanes (the layout of a tile of one input row).
Q8_TARGET inline __m512i row_totals(const __m512i (&v)[4]) {
  alignas(64) static constexpr int32_t TO_ROW[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  __m512i t = sum_chunks4(v);  // lane 4 c + r: chunk c of v[r]
  t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0x4E));  // + the chunk two away
  t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));  // + the neighbouring chunk: lane r of every chunk = v[r]'s sum
  return _mm512_permutexvar_epi32(_mm512_load_si512(TO_ROW), t);
}

// q4k_value / q6k_value in 16 lanes: each lane the same fp32 operations in the same order.
Q8_TARGET inline __m512 q4k_value16(__m512 d, __m512 dmin, __m512 dx, __m512i I, __m512i Mn) {
  return _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(I)), _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(Mn)));
}

Q8_TARGET inline __m512 q6k_value16(__m512 d, __m512 dx, __m512i I) { return _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(I)); }

// The block's integer dot products of one output row (its codes and scales) with one input row,
// in 16 lanes.
Q8_TARGET inline __m512i codes_lanes(const __m512i* codes, const __m512i* scales, const int8_t* xq) {
  __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains: half the latency
  for (int v = 0; v < 4; ++v)
    acc[v % 2] = _mm512_dpwssd_epi32(acc[v % 2], _mm512_maddubs_epi16(codes[v], _mm512_loadu_si512(xq + 64 * v)), scales[v]);
  return _mm512_add_epi32(acc[0], acc[1]);
}

template <int NR, int MR, bool Q4K>
Q8_TARGET void q8_tile(const QuantizedRows& xr, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* y,
                       int64_t ldy) {
  static_assert(NR <= 4 && MR <= 8, "a tile is at most 4 x 8");
  constexpr int G = (MR + 3) / 4;  // groups of four input rows: group g's pair (r, m) in lane 4 r + m - 4 g of vector g
  // lane 4 r + m takes input row m's scale, and the fp16 pair (d, dmin) of row r: halves 2 r, 2 r + 1
  alignas(64) static constexpr int32_t TO_M[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  alignas(64) static constexpr int32_t TO_D[16] = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
  alignas(64) static constexpr int32_t TO_DMIN[16] = {1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7};
  const __m512i to_m = _mm512_load_si512(TO_M), to_d = _mm512_load_si512(TO_D), to_dmin = _mm512_load_si512(TO_DMIN);
  __m512 acc[G];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < xr.K / QK; ++b) {
    __m512i rows[G][4];  // rows[g][r]: lane 4 c + m = chunk c of (r, 4 g + m)'s dot products
    __m128i halves = _mm_setzero_si128();  // 32-bit lane r: row r's first four bytes (Q4_K d, dmin; Q6_K d, 0)
    const uint8_t* blks[4];
    for (int r = 0; r < NR; ++r) blks[r] = block_at<NR>(w, r, row_bytes, b, Q4K ? 144 : 210);
    // Q4_K: the rows' scales and mins unpacked together (chunk r: row r's sc_0..7, m_0..7), and
    // mins chunk r = row r's eight mins as 16-bit
    __m512i mins = _mm512_setzero_si512(), pair_scales16[2];  // pair_scales16[i]: rows 2 i, 2 i + 1's sc, m as 16-bit
    if constexpr (Q4K) {
      __m512i raw = _mm512_setzero_si512();
      for (int r = 0; r < NR; ++r)
        raw = _mm512_mask_broadcast_i32x4(raw, static_cast<__mmask16>(0xF << (4 * r)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(blks[r] + 4)));
      const __m512i unpacked = q4k_scales_mins4(raw);
      pair_scales16[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(unpacked));
      pair_scales16[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(unpacked, 1));
      const __m512i to_mins = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15, -128));
      mins = _mm512_shuffle_epi8(unpacked, to_mins);
    }
    for (int r = 0; r < 4; ++r) {
      __m512i sums[G][4];
      for (auto& group : sums)
        for (auto& v : group) v = _mm512_setzero_si512();
      if (r < NR) {
        const uint8_t* blk = blks[r];
        uint32_t scale_bytes;
        if constexpr (Q4K) {
          const Q4KCodes c = q4k_codes(blk, pair_scales16[r / 2], r % 2);
          for (int m = 0; m < MR; ++m) sums[m / 4][m % 4] = codes_lanes(c.codes, c.scales, xr.q_at(m0 + m, b));
          std::memcpy(&scale_bytes, blk, 4);
        } else {  // the -32 offset folded in: sum_j (-32 sc_j) bs16[j] in 16-bit products
          const Q6KCodes c = q6k_codes(blk);
          const __m512i offsets = _mm512_zextsi256_si512(_mm256_mullo_epi16(c.sc16, _mm256_set1_epi16(-32)));
          for (int m = 0; m < MR; ++m) {
            const __m512i bs = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.bs_at(m0 + m, b))));
            sums[m / 4][m % 4] = _mm512_dpwssd_epi32(codes_lanes(c.codes, c.scales, xr.q_at(m0 + m, b)), bs, offsets);
          }
          uint16_t d16;
          std::memcpy(&d16, blk + 208, 2);
          scale_bytes = d16;
        }
        halves = _mm_mask_set1_epi32(halves, static_cast<__mmask8>(1 << r), static_cast<int>(scale_bytes));
      }
      if constexpr (MR == 1) rows[0][r] = sums[0][0];  // one input row: the four rows' sums reduced together below
      else
        for (int g = 0; g < G; ++g) rows[g][r] = sum_chunks4(sums[g]);
    }
    const __m512 scales = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));  // fp16 -> fp32: exact
    const __m512 ds = _mm512_permutexvar_ps(to_d, scales), dmins = _mm512_permutexvar_ps(to_dmin, scales);
    for (int g = 0; g < G; ++g) {
      const __m512 dxs = _mm512_permutexvar_ps(to_m, _mm512_castps128_ps512(_mm_loadu_ps(xr.ds_at(m0 + 4 * g, b))));
      const __m512i I = MR == 1 ? row_totals(rows[0]) : sum_across_chunks(rows[g]);
      if constexpr (Q4K) {  // Mn: row r's mins times input row m's sums of 32, chunk r of mn[m]
        __m512i mn[4];
        for (int m = 0; m < 4; ++m)
          mn[m] = 4 * g + m < MR
                      ? _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr.bs32_at(m0 + 4 * g + m, b)))))
                      : _mm512_setzero_si512();
        acc[g] = _mm512_add_ps(acc[g], q4k_value16(ds, dmins, dxs, I, sum_chunks4(mn)));
      } else {
        acc[g] = _mm512_add_ps(acc[g], q6k_value16(ds, dxs, I));
      }
    }
  }
  alignas(64) float lanes[G][16];
  for (int g = 0; g < G; ++g) _mm512_store_ps(lanes[g], acc[g]);
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = bias ? lanes[m / 4][4 * r + m % 4] + bias[r] : lanes[m / 4][4 * r + m % 4];
}

enum class Q8Path { avx512_vnni, avx2, scalar };

Q8Path auto_path() { return has_vnni() ? Q8Path::avx512_vnni : isa() != Isa::none ? Q8Path::avx2 : Q8Path::scalar; }

Q8Path path_named(const std::string& name) {
  if (name == "auto") return auto_path();
  const Q8Path path = name == "avx512_vnni" ? Q8Path::avx512_vnni : name == "avx2" ? Q8Path::avx2 : Q8Path::scalar;
  TORCH_CHECK(name == "avx512_vnni" || name == "avx2" || name == "scalar", "linear_gguf_q8: unknown path '", name,
              "' (auto, avx512_vnni, avx2, scalar)");
  TORCH_CHECK(path != Q8Path::avx512_vnni || has_vnni(), "linear_gguf_q8: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(path != Q8Path::avx2 || isa() != Isa::none, "linear_gguf_q8: this CPU has no AVX2");
  return path;
}

// Output rows n0 .. n1 - 1 in tiles of 4 (single rows at the end), each against the input rows in
// groups of up to 8: a tile's weights come from memory for the first group and from cache for the
// others. (Tiles of 16 rows for one input row, lane r, were tried: slower than these over the
// 1.5B's layers in an unlogged timing, 16 rows being 16 streams from memory.)
template <typename RowsFn>
void q8_blocks(int64_t M, int64_t n0, int64_t n1, RowsFn&& rows_fn) {
  const auto groups = [&](auto nr, int64_t n) {
    run_rows(M, 8, [&](int64_t r0, int rows) { with_rows<8>(rows, [&](auto mr) { rows_fn(nr, mr, r0, n); }); });
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) groups(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) groups(std::integral_constant<int, 1>{}, n);
}

void q8_range(const QuantizedRows& xr, int64_t M, const uint8_t* w, int64_t row_bytes, bool q4k, const float* bias, float* y,
              int64_t N, int64_t n0, int64_t n1, Q8Path path) {
  if (path == Q8Path::scalar) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < xr.K / QK; ++b) {
          const uint8_t* blk = w + n * row_bytes + b * (q4k ? 144 : 210);
          acc += q4k ? q4k_block_scalar(blk, xr.q_at(m, b), xr.d_at(m, b), xr.bs_at(m, b))
                     : q6k_block_scalar(blk, xr.q_at(m, b), xr.d_at(m, b), xr.bs_at(m, b));
        }
        y[m * N + n] = bias ? acc + bias[n] : acc;
      }
    return;
  }
  q8_blocks(M, n0, n1, [&](auto nr, auto mr, int64_t r0, int64_t n) {
    constexpr int R = decltype(nr)::value, MR = decltype(mr)::value;
    const uint8_t* wn = w + n * row_bytes;
    const float* bn = bias ? bias + n : nullptr;
    float* yn = y + r0 * N + n;
    if (path == Q8Path::avx512_vnni) {
      if (q4k) q8_tile<R, MR, true>(xr, r0, wn, row_bytes, bn, yn, N);
      else q8_tile<R, MR, false>(xr, r0, wn, row_bytes, bn, yn, N);
    } else if constexpr (MR == 1) {
      if (q4k) q8_row_avx2<R, true>(xr, r0, wn, row_bytes, bn, yn);
      else q8_row_avx2<R, false>(xr, r0, wn, row_bytes, bn, yn);
    } else {
      if (q4k) q8_rows_avx2<R, MR, true>(xr, r0, wn, row_bytes, bn, yn, N);
      else q8_rows_avx2<R, MR, false>(xr, r0, wn, row_bytes, bn, yn, N);
    }
  });
}

}  // namespace

bool gguf_q8_supported(int64_t qtype) { return qtype == 12 || qtype == 14; }

std::string gguf_q8_isa() {
  const Q8Path path = auto_path();
  return path == Q8Path::avx512_vnni ? "avx512_vnni" : path == Q8Path::avx2 ? "avx2" : "scalar";
}

torch::Tensor linear_gguf_q8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t N,
                             const c10::optional<torch::Tensor>& bias, const std::string& path) {
  TORCH_CHECK(gguf_q8_supported(qtype), "linear_gguf_q8: GGUF block type ", qtype,
              " has no int8-activation kernel (Q4_K = 12, Q6_K = 14; the others run linear_gguf)");
  expect(x, "linear_gguf_q8", "x", torch::kFloat32, Layout::unit_inner);
  expect(blocks, "linear_gguf_q8", "blocks", torch::kUInt8, Layout::contiguous);
  TORCH_CHECK(x.dim() == 2, "linear_gguf_q8: x must be 2-D [M, K]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == N, "linear_gguf_q8: blocks must be [N, row bytes] with N = ", N);
  expect_bias(bias, "linear_gguf_q8", N);
  const int64_t M = x.size(0), K = x.size(1);
  const bool q4k = qtype == 12;
  TORCH_CHECK(K % QK == 0, "linear_gguf_q8: K = ", K, " is not a whole number of 256-weight blocks");
  TORCH_CHECK(blocks.size(1) == K / QK * (q4k ? 144 : 210), "linear_gguf_q8: a row of K = ", K, " weights is ",
              K / QK * (q4k ? 144 : 210), " bytes, blocks has ", blocks.size(1));
  const Q8Path which = path_named(path);
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xr = quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, q4k, which == Q8Path::avx512_vnni);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { q8_range(xr, M, wp, blocks.size(1), q4k, bp, yp, N, n0, n1, which); });
  return y;
}

}  // namespace cascade_native
