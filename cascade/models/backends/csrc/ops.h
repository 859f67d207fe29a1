// The native operations as the other files and the Python bindings see them, and the operator
// records the lean forward's layers are built from (cascade/models/backends/lean.py).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace cascade_native {

// linear.cpp: y = x @ W^T (+ bias), W packed fp16 / int8 (per channel) / int4 (per group)
torch::Tensor linear_fp16(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t N,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t group,
                          int64_t N, const c10::optional<torch::Tensor>& bias);
// int8_dot.cpp: int8 activations times int8 / int4 weights, integer sums
torch::Tensor linear_int8_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& colsum,
                               const torch::Tensor& scale, int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_int4_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                               int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias);
std::string int8_dot_isa();
// gguf.cpp: W held as a GGUF file's blocks ([N, K / QK * bytes] uint8), each weight dequantized
// exactly as the reference does, fp32 sums
torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t N,
                          const c10::optional<torch::Tensor>& bias, const std::string& path = "auto");
torch::Tensor dequantize_gguf(const torch::Tensor& blocks, int64_t qtype, int64_t K, const c10::optional<torch::Tensor>& rows,
                              const std::string& path = "auto");
int64_t gguf_block_weights(int64_t qtype);
// gguf_q8.cpp: Q4_K / Q6_K blocks times activations quantized per 256 to int8, integer sums
torch::Tensor linear_gguf_q8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype, int64_t N,
                             const c10::optional<torch::Tensor>& bias, const std::string& path);
bool gguf_q8_supported(int64_t qtype);
std::string gguf_q8_isa();
int64_t gguf_block_bytes(int64_t qtype);
// attention.cpp
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scaling);
// bandwidth.cpp: every byte of a uint8 buffer read once (folded by XOR: the result is returned)
int64_t stream_read(const torch::Tensor& buffer, bool into_l2);
// norm_rope.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t lanes);
void rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor add_residual(torch::Tensor y, const torch::Tensor& h);

struct NormOp {
  torch::Tensor weight;  // [E]
  double eps;
  int64_t lanes;

  torch::Tensor operator()(const torch::Tensor& x) const;  // [n, E] -> [n, E] (norm_rope.cpp)
};

// A native linear layer as these calls run it: which kernel, and the tensors it reads (shared
// with the Python module that made it; nothing is copied).
struct LinearOp {
  // The kernels a LinearOp runs; Python names them through the bound enum LinearKind (each
  // native linear module's KIND is a member's name), so the values live here only.
  enum Kind { fp16, int8, int8_vnni, int4, int4_vnni, gguf, gguf_q8 };
  Kind kind;
  torch::Tensor packed, scale, colsum;  // scale: int8 [P*32] / int4 scales [P, K/G, 32]; colsum: int8_vnni
  int64_t group, N;  // group: int4's group size; gguf: the ggml block type
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case fp16: return linear_fp16(x, packed, N, bias);
      case int8: return linear_int8(x, packed, scale, N, bias);
      case int8_vnni: return linear_int8_vnni(x, packed, colsum, scale, N, bias);
      case int4: return linear_int4(x, packed, scale, group, N, bias);
      case int4_vnni: return linear_int4_vnni(x, packed, scale, group, N, bias);
      case gguf: return linear_gguf(x, packed, group, N, bias);
      case gguf_q8: return linear_gguf_q8(x, packed, group, N, bias, "auto");
    }
    TORCH_CHECK(false, "unknown LinearOp kind ", static_cast<int>(kind));
  }
};

// Linear layers that read the same input as one call: either one op whose output columns are

// One decoder layer's operators (built once per layer in Python: cascade/models/backends/lean.py).
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

// Every decoder layer in one call (each as layer_step), for a forward whose layers are all
// fused and whose cache layers are all preallocated: the interpreter's work per layer (the call,
// its arguments) was ~10-20 us of a drafter's ~0.35 ms layer. layer i writes this call's keys
// and values into k_bufs[i] / v_bufs[i] at starts[i]. Returns [h after the last layer] then, for
// each entry of keep_after (a count of layers, 1 <= c <= the layer count), h after that many
// layers.
struct DecoderOps {
  std::vector<LayerOps> layers;
};

// decoder.cpp
std::vector<torch::Tensor> layer_qkv(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& cos,
                                     const torch::Tensor& sin);
torch::Tensor layer_rest(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& keys,
                         const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, const LayerOps& L);
torch::Tensor layer_step(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                         int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                         const c10::optional<torch::Tensor>& mask);
std::vector<torch::Tensor> decoder_step(torch::Tensor h, const DecoderOps& D, const std::vector<torch::Tensor>& k_bufs,
                                        const std::vector<torch::Tensor>& v_bufs, const std::vector<int64_t>& starts,
                                        const torch::Tensor& cos, const torch::Tensor& sin,
                                        const c10::optional<torch::Tensor>& mask, const std::vector<int64_t>& keep_after);
std::string isa_name();

}  // namespace cascade_native
