// The lean forward's decoder layer as native calls (cascade/models/backends/lean.py builds the operator records).

#include "kernels.h"
#include "ops.h"

namespace cascade_native {

// ---- the lean forward's decoder layer ------------------------------------------------------
// What a layer of the lean forward does, as native calls: the Python interpreter's work between
// ~20 small operations per layer was ~0.15-0.2 ms of a drafter's layer (a third of the int4
// 0.5B's token). The same operations, in the same order, on the same kernels as the per-op path
// (cascade/models/backends/lean.py), so the results are bitwise the same (tested against transformers'
// forward).

// the parts' side by side (their panels concatenated, cascade/models/backends/native.py: side_by_side; every
// column computed as in its own layer, so bitwise the separate calls), or the separate ops,
// whose outputs are concatenated. -> [n, sum of widths].
torch::Tensor side_by_side(const std::vector<LinearOp>& ops, const torch::Tensor& x) {
  if (ops.size() == 1) return ops[0](x);
  std::vector<torch::Tensor> parts;
  for (const auto& op : ops) parts.push_back(op(x));
  return torch::cat(parts, 1);
}


// h [n, E] -> q [1, H, n, D] (fresh) and the layer's keys and values for this call written into
// k_out / v_out [1, Hkv, n, D]: the input norm, the projections, RoPE on q and k.
torch::Tensor qkv_part(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& cos, const torch::Tensor& sin,
                       torch::Tensor& k_out, torch::Tensor& v_out) {
  const int64_t n = h.size(0), D = L.head_dim;
  auto y = side_by_side(L.qkv, L.in_norm(h));  // [n, nq + nk + nv]
  auto q = y.narrow(1, 0, L.nq).view({1, n, -1, D}).transpose(1, 2);
  auto k = y.narrow(1, L.nq, L.nk).view({1, n, -1, D}).transpose(1, 2);
  auto v = y.narrow(1, L.nq + L.nk, y.size(1) - L.nq - L.nk).view({1, n, -1, D}).transpose(1, 2);
  rope_into(k, cos, sin, k_out);
  v_out.copy_(v);
  return rope(q, cos, sin);
}

// The rest of the layer once keys / values [1, Hkv, L, D] hold this call's: attention, o_proj,
// the residual, the post-attention norm, the gated MLP, the residual.
torch::Tensor rest_part(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& keys,
                        const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, const LayerOps& L) {
  const int64_t n = h.size(0);
  auto out = attention(q, keys, values, mask, L.scaling);  // [1, n, H, D]
  auto h1 = add_residual(L.o_proj(out.reshape({n, -1})), h);
  auto y = side_by_side(L.gate_up, L.post_norm(h1));  // [n, 2 I]: gate, up
  const int64_t inter = y.size(1) / 2;
  return add_residual(L.down_proj(silu_mul(y.narrow(1, 0, inter), y.narrow(1, inter, inter))), h1);
}

// The layer around a cache update made in Python (a cache whose layers are not
// cascade's preallocated buffers): [q, k, v] fresh, then rest_part.
std::vector<torch::Tensor> layer_qkv(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t n = h.size(0), D = L.head_dim, kv_heads = L.nk / D;
  auto k = torch::empty({1, kv_heads, n, D}, h.options());
  auto v = torch::empty({1, kv_heads, n, D}, h.options());
  auto q = qkv_part(h, L, cos, sin, k, v);
  return {q, k, v};
}

torch::Tensor layer_rest(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& keys,
                         const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, const LayerOps& L) {
  return rest_part(h, q, keys, values, mask, L);
}

// The whole layer as one call on a preallocated cache: this call's keys / values are written
// straight into positions [start, start + n) of the buffers k_buf / v_buf [1, Hkv, capacity, D]
// (reserved by the caller, cascade/models/kv_cache.py), and the attention reads positions
// [0, start + n) of them. Bitwise layer_qkv + the cache's update + layer_rest.
torch::Tensor layer_step(const torch::Tensor& h, const LayerOps& L, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                         int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                         const c10::optional<torch::Tensor>& mask) {
  const int64_t n = h.size(0);
  expect(h, "layer_step", "h", torch::kFloat32, Layout::unit_inner);
  expect(k_buf, "layer_step", "k_buf", torch::kFloat32, Layout::unit_inner);
  expect(v_buf, "layer_step", "v_buf", torch::kFloat32, Layout::unit_inner);
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.sizes() == k_buf.sizes() && start >= 0 && start + n <= k_buf.size(2),
              "layer_step: k_buf / v_buf [1, Hkv, capacity, D] with room for positions [start, start + n)");
  auto k_out = k_buf.narrow(2, start, n), v_out = v_buf.narrow(2, start, n);
  auto q = qkv_part(h, L, cos, sin, k_out, v_out);
  return rest_part(h, q, k_buf.narrow(2, 0, start + n), v_buf.narrow(2, 0, start + n), mask, L);
}


std::vector<torch::Tensor> decoder_step(torch::Tensor h, const DecoderOps& D, const std::vector<torch::Tensor>& k_bufs,
                                        const std::vector<torch::Tensor>& v_bufs, const std::vector<int64_t>& starts,
                                        const torch::Tensor& cos, const torch::Tensor& sin,
                                        const c10::optional<torch::Tensor>& mask, const std::vector<int64_t>& keep_after) {
  const size_t count = D.layers.size();
  TORCH_CHECK(k_bufs.size() == count && v_bufs.size() == count && starts.size() == count,
              "decoder_step: one key buffer, value buffer and start per layer (", count, " layers)");
  for (int64_t c : keep_after)
    TORCH_CHECK(c >= 1 && c <= static_cast<int64_t>(count), "decoder_step: keep_after counts layers in [1, ", count, "]");
  std::vector<torch::Tensor> kept(keep_after.size());
  for (size_t i = 0; i < count; ++i) {
    h = layer_step(h, D.layers[i], k_bufs[i], v_bufs[i], starts[i], cos, sin, mask);
    for (size_t j = 0; j < keep_after.size(); ++j)
      if (keep_after[j] == static_cast<int64_t>(i + 1)) kept[j] = h;
  }
  std::vector<torch::Tensor> out{h};
  out.insert(out.end(), kept.begin(), kept.end());
  return out;
}

std::string isa_name() {
  switch (isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "none";
  }
}


}  // namespace cascade_native
