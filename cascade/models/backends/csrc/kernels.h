// The layout and loops every kernel file shares: panels of NC output columns, the prefetch
// distance, the instruction set found at run time, row blocks and panel groups, and the checks of
// every tensor argument. (The design notes of the linear kernels: linear.cpp.)
#pragma once

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

namespace cascade_native {

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
// The weight streams' prefetches fill L1 (T0): the fp16 and int4 kernels' one-row passes reach
// 90-100% of the read bound with them. The GGUF int8 kernel's prefetches fill L2 (gguf_q8.cpp,
// prefetch_to_l2: there T0 held the core's few L1 miss buffers and halved its one-row rate);
// the same for these kernels was not measured interleaved (one pair of runs on a Zen 4 EPYC,
// results/kernels/forward_cost_prefetch_zen4.log, showed no gain).
// HINT: the cache level to fill (_MM_HINT_T0 by default; the read probe times T1 too).
template <int HINT = _MM_HINT_T0>
inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), static_cast<decltype(_MM_HINT_T0)>(HINT));  // an enum in GCC
}
template <int HINT = _MM_HINT_T0>
inline void prefetch_ahead(const void* p) { prefetch_line<HINT>(static_cast<const char*>(p) + PREFETCH_BYTES); }

// The int4 kernels' second stream: a group's 32 fp32 scales (two cache lines) per panel, read once
// per G k, prefetched as far ahead, in groups, as the weights are (the 0.5B's int4 x int8 layers
// at one row: 1.04-1.05x faster than without, experiments/linear_revision.py,
// results/kernels/linear_revision_scale_prefetch.log).
inline void prefetch_scales(const float* group_scales, int64_t G) {
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / (G * NC / 2)) * NC;  // floats
  prefetch_line(group_scales + ahead);
  prefetch_line(group_scales + ahead + NC / 2);
}


// ---- dispatch --------------------------------------------------------------------------------

enum class Isa { none, avx2, avx512 };

inline Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return Isa::avx2;
  return Isa::none;
}

inline Isa isa() {
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

// AVX-512 VNNI (with F and BW) here: the int8 x int8 and int4 x int8 kernels' fast path.
inline bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}


// Every tensor an op reads: on the CPU (the kernels dereference its data pointer), of the dtype
// the kernel reads, and laid out as the kernel walks it (contiguous; unit stride along the last
// dimension; or any strides, read through them).
enum class Layout { contiguous, unit_inner, strided };

inline void expect(const torch::Tensor& t, const char* op, const char* name, c10::ScalarType dtype, Layout layout) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is missing");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", c10::toString(dtype), ", got ", t.scalar_type());
  if (layout == Layout::contiguous) TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  if (layout == Layout::unit_inner)
    TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name, " needs unit stride along its last dimension");
}

inline void expect_bias(const c10::optional<torch::Tensor>& bias, const char* op, int64_t N) {
  if (!bias) return;
  expect(*bias, op, "bias", torch::kFloat32, Layout::contiguous);
  TORCH_CHECK(bias->numel() == N, op, ": bias must be [N] fp32");
}

inline void check_inputs(const char* op, const torch::Tensor& x, const torch::Tensor& packed, c10::ScalarType packed_dtype, int64_t N,
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


}  // namespace cascade_native
