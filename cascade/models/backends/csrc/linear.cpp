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
// Layout (packed in Python, cascade/models/backends/native.py): the N output columns are cut into
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

#include "kernels.h"
#include "simd_rows.h"
#include "ops.h"

namespace cascade_native {

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
        rows_avx512<1, 1>(xp, ldx, wp + p * K * NC, K * NC, K, nullptr, bp ? bp + p * NC : nullptr, yp + p * NC, N,
                          pass_ncols(N, p, 1));
      return;
    }
    if (which == Isa::avx512 && M <= MRF16) {  // one block: each weight read once
      with_rows<MRF16>(static_cast<int>(M), [&](auto r) {
        constexpr int MR = decltype(r)::value;
        panel_passes<MR>(count, [&](int q, auto pp) {
          constexpr int PP = decltype(pp)::value;
          const int64_t p = pg + q;
          rows_avx512<MR, PP>(xp, ldx, wp + p * K * NC, K * NC, K, nullptr, bp ? bp + p * NC : nullptr, yp + p * NC, N,
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
            rows_avx512<decltype(r)::value, 1>(xp + r0 * ldx, ldx, wp + p * K * NC, K * NC, K, nullptr,
                                               bp ? bp + p * NC : nullptr, yp + r0 * N + p * NC, N, pass_ncols(N, p, 1));
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
            rows_avx512<MR, PP>(xp + r0 * ldx, ldx, wp + p * K * NC, K * NC, K, sp + p * NC,
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


}  // namespace cascade_native
