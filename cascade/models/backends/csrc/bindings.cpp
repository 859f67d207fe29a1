// The extension's Python module: cascade/models/backends/native.py and cascade/models/backends/lean.py call these.

#include "kernels.h"
#include "ops.h"

using namespace cascade_native;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::enum_<LinearOp::Kind>(m, "LinearKind", "the kernels a LinearOp runs (ops.h's LinearOp::Kind)")
      .value("fp16", LinearOp::fp16)
      .value("int8", LinearOp::int8)
      .value("int8_vnni", LinearOp::int8_vnni)
      .value("int4", LinearOp::int4)
      .value("int4_vnni", LinearOp::int4_vnni)
      .value("gguf", LinearOp::gguf)
      .value("gguf_q8", LinearOp::gguf_q8);
  py::class_<LinearOp>(m, "LinearOp", "a native linear layer as layer_qkv / layer_rest run it")
      .def(py::init([](LinearOp::Kind kind, torch::Tensor packed, c10::optional<torch::Tensor> scale,
                       c10::optional<torch::Tensor> colsum, int64_t group, int64_t N, c10::optional<torch::Tensor> bias) {
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
  m.def("stream_read", &stream_read, "every byte of a contiguous uint8 buffer read once at the kernels' prefetch distance, "
        "prefetching into L1 or (into_l2) L2 (the read-bandwidth bound: the faster); returns the bytes folded by XOR",
        py::arg("buffer"), py::arg("into_l2") = false);
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
  m.def("linear_gguf", &linear_gguf, "y = x @ W^T (+ bias), W a GGUF file's blocks [N, K / QK * bytes] of type qtype, "
        "each weight dequantized exactly as the gguf reference, fp32 sums; path: auto (this CPU's fastest), avx512 or avx2",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("n"), py::arg("bias") = py::none(), py::arg("path") = "auto");
  m.def("dequantize_gguf", &dequantize_gguf, "rows of a GGUF block tensor as fp32 by a path's decode: auto (the kernel's "
        "on this CPU), avx512, avx2 or scalar (the reference's operations one weight at a time)", py::arg("blocks"),
        py::arg("qtype"), py::arg("k"), py::arg("rows") = py::none(), py::arg("path") = "auto");
  m.def("linear_gguf_q8", &linear_gguf_q8, "y = x @ W^T (+ bias) for Q4_K / Q6_K blocks with x quantized per 256 to int8: "
        "integer sums, a fixed fp32 epilogue per block; path: auto (this CPU's fastest), avx512_vnni, avx2 or scalar, "
        "the same bits", py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("path") = "auto");
  m.def("gguf_q8_isa", &gguf_q8_isa, "the path linear_gguf_q8 takes here: avx512_vnni, avx2 or scalar");
  m.def("gguf_q8_supported", &gguf_q8_supported, "whether a ggml block type has the int8-activation kernel", py::arg("qtype"));
  m.def("gguf_block_weights", &gguf_block_weights, "weights per block of a ggml type", py::arg("qtype"));
  m.def("gguf_block_bytes", &gguf_block_bytes, "bytes per block of a ggml type", py::arg("qtype"));
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)); lanes 16 / 8: ATen's "
        "vector width (bitwise its result), 0: ATen's operations", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("lanes") = 0);
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::arg("gate"), py::arg("up"));
  m.def("linear_int4", &linear_int4, "y = x @ ((Q - 8) * s)^T (+ bias), Q packed int4 [P, K, 16]", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("n"), py::arg("bias") = py::none());
}
