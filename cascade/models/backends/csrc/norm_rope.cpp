// RMSNorm, RoPE, the gated MLP's silu * up and the residual add: ATen's results bit for bit, one call each.

#include "kernels.h"
#include "ops.h"

namespace cascade_native {

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
torch::Tensor NormOp::operator()(const torch::Tensor& x) const {  // [n, E] -> [n, E]
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


}  // namespace cascade_native
