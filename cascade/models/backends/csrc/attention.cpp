// Attention over the KV cache for the few queries of a decoding or verification step (fp32).

#include "kernels.h"
#include "ops.h"

namespace cascade_native {

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


}  // namespace cascade_native
