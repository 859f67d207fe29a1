"""cascade's native CPU kernels (cascade/models/backends/native.py, csrc/) and the lean
forward: accuracy against an fp64 reference within the stated fp32 bound on every linear shape
the zoo's models use, odd sizes, 1-32 rows and non-contiguous inputs; bitwise row invariance
(row i of an M-row call is the 1-row call on row i, M = 1..32) for the linears and the attention
over the cache; the lean forward bitwise equal to transformers' forward on the same kernels
(chains, tree masks, hidden states, crop and compaction); greedy equality of speculative
decoding on the backend; the fallback when the extension is disabled.

The extension is built on first use (about 30 s). On an x86 machine a build failure fails these
tests (CI must build it); elsewhere, or with CASCADE_NATIVE=0, they skip with the reason.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from cascade.models.backends.native import (NativeFP16Linear, NativeInt4Linear, NativeInt4VNNILinear, NativeInt8Linear,
                                   NativeInt8VNNILinear, fp32_sum_bound, pack_int4_vnni, unpack_int4_vnni,
                                   native_kernels,
                                   native_attention, side_by_side, swap_linears, unavailable_reason)

X86 = platform.machine().lower() in ("x86_64", "amd64")
DISABLED = os.environ.get("CASCADE_NATIVE", "1") == "0"
pytestmark = pytest.mark.skipif(DISABLED or not X86, reason="native kernels disabled (CASCADE_NATIVE=0) or not x86")

# (in, out) of every linear layer of the zoo's models (SmolLM2-135M, Qwen2.5-Coder-0.5B, -1.5B),
# the LM heads included, then odd sizes (tails of a 32-column panel, K of 1)
MODEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152),
                (896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936),
                (1536, 1536), (1536, 256), (1536, 8960), (8960, 1536), (1536, 151936)]
ODD_SHAPES = [(37, 45), (1, 17), (64, 33), (130, 7), (8, 16)]
HEADS = {(576, 49152), (896, 151936), (1536, 151936)}


def test_extension_builds_here():
    assert native_kernels() is not None, f"native kernels unavailable: {unavailable_reason()}"
    assert native_kernels().isa() in ("avx512", "avx2")


def _fp16_linear(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_((torch.randn(n, k, generator=gen) * 0.05).half().float())
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def _within_bound(y: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> bool:
    """|y - x.W^T - b| <= gamma_K sum_k |x_k w_k| + (the bias add's rounding)."""
    w = lin.weight.double()
    ref = x.double() @ w.T
    bound = fp32_sum_bound(x.shape[-1]) * (x.double().abs() @ w.abs().T)
    if lin.bias is not None:
        ref = ref + lin.bias.double()
        bound = bound + 2.0 ** -24 * ref.abs()
    return bool(((y.double() - ref).abs() <= bound * (1 + 1e-9) + 1e-38).all())


@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp16_linear_within_fp32_bound(shape):
    k, n = shape
    lin = _fp16_linear(k, n, bias=shape in ODD_SHAPES or n == 256, seed=k + n)
    native = NativeFP16Linear(lin)
    rows = (1, 3) if shape in HEADS else (1, 2, 5, 8, 13, 32)
    gen = torch.Generator().manual_seed(1)
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        assert _within_bound(native(x), x, lin), (shape, m)
    for x in (torch.randn(3, 2 * k, generator=gen)[:, ::2], torch.randn(k, 3, generator=gen).T):  # strided along K, transposed
        assert (k == 1 or not x.is_contiguous()) and _within_bound(native(x), x, lin)
    x3 = torch.randn(2, 3, k, generator=gen)  # [..., in] inputs keep their leading shape
    assert native(x3).shape == (2, 3, n) and _within_bound(native(x3).reshape(6, n), x3.reshape(6, k), lin)
    assert torch.equal(native.dense_state()["weight"], lin.weight.detach())


def _vnni() -> bool:
    return native_kernels() is not None and native_kernels().has_vnni()


def _int8_dot() -> bool:  # the int4 x int8 kernel: AVX-512 VNNI or AVX2
    return native_kernels() is not None and native_kernels().int8_dot_isa() != "none"


def _needs(kind: str | None) -> str | None:  # why a kernel kind cannot run here (None: it can)
    if kind == "int8_vnni" and not _vnni():
        return "no AVX-512 VNNI on this CPU"
    if kind == "int4_vnni" and not _int8_dot():
        return "no int4 x int8 kernel on this CPU"
    return None


KINDS = {"fp16": NativeFP16Linear, "int8": NativeInt8Linear, "int4": NativeInt4Linear,
         "int8_vnni": NativeInt8VNNILinear, "int4_vnni": NativeInt4VNNILinear}  # kind -> module


def test_python_kinds_are_the_extensions_enum():
    """Each native linear module names a member of the extension's LinearKind (ops.h's enum, the
    one place the values live), and every member has a module."""
    from cascade.models.backends.gguf_weights import NativeGGUFLinear, NativeGGUFQ8Linear
    from cascade.models.backends.native import _ext, native_kernels

    if native_kernels() is None:
        pytest.skip("cascade's native kernels do not build here")
    modules = [*KINDS.values(), NativeGGUFLinear, NativeGGUFQ8Linear]
    assert sorted(m.KIND for m in modules) == sorted(_ext().LinearKind.__members__)
    assert all(m.KIND == kind for kind, m in KINDS.items())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(1536, 256), (896, 4864), (64, 45), (128, 33), (256, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_are_bitwise_invariant(kind, shape):
    """Row i of an M-row call equals the 1-row call on row i, bit for bit, for M = 1..32 (the
    1-3 row passes run several panels side by side: 200 columns = 6 full panels and a tail)."""
    if _needs(kind):
        pytest.skip(_needs(kind))
    k, n = shape
    if kind.startswith("int4") and k % 64:
        pytest.skip("int4 needs K divisible by 64")
    lin = _fp16_linear(k, n, bias=True, seed=3)
    module = KINDS[kind](lin)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(2))
    singles = torch.cat([module(x[i:i + 1]) for i in range(32)])
    for m in range(1, 33):
        assert torch.equal(module(x[:m]), singles[:m]), m


@pytest.mark.parametrize("kind", list(KINDS))
def test_side_by_side_op_is_bitwise_the_separate_layers(kind):
    """Layers reading one input joined into one op (q / k / v, gate / up): its output is the
    separate layers' outputs side by side bit for bit (the last layer's partial panel included),
    the layers keep working on views of the joined buffer, and layers that cannot be joined
    (a width before the last that is not whole panels, or another kernel) are refused."""
    if _needs(kind):
        pytest.skip(_needs(kind))
    k = 128
    layers = [KINDS[kind](_fp16_linear(k, n, bias=True, seed=10 + n)) for n in (96, 64, 45)]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    separate = torch.cat([m(x) for m in layers], dim=1)
    op = side_by_side(layers)
    assert torch.equal(op(x), separate)
    assert torch.equal(torch.cat([m(x) for m in layers], dim=1), separate)  # the layers on their views
    assert layers[0].packed.data_ptr() < layers[1].packed.data_ptr() < layers[2].packed.data_ptr()
    assert layers[0].packed.untyped_storage().data_ptr() == layers[2].packed.untyped_storage().data_ptr()
    assert side_by_side([KINDS[kind](_fp16_linear(k, 45, bias=True, seed=1)),
                         KINDS[kind](_fp16_linear(k, 64, bias=True, seed=2))]) is None
    other = NativeFP16Linear if kind != "fp16" else NativeInt8Linear
    assert side_by_side([KINDS[kind](_fp16_linear(k, 64, bias=True, seed=1)), other(_fp16_linear(k, 64, bias=True, seed=2))]) is None


def test_rope_is_bitwise_transformers_rotary():
    """The native RoPE (one loop) gives bitwise transformers' apply_rotary_pos_emb (three ATen
    operations), on a strided q as the joined projection's output is."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    n, heads, d = 7, 6, 64
    y = torch.randn(n, heads * d + 96, generator=gen) * 30  # q beside other columns
    q = y[:, : heads * d].view(1, n, heads, d).transpose(1, 2)  # [1, H, n, D], strided
    cos, sin = torch.randn(1, n, d, generator=gen), torch.randn(1, n, d, generator=gen)
    ref, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert torch.equal(native_kernels().rope(q, cos[:, None], sin[:, None]), ref)


def test_native_rms_norm_is_bitwise_atens_sum_order():
    """The native RMSNorm reproduces ATen's cascade sum: bitwise transformers' Qwen2 RMSNorm at
    every width 1..300 (the scalar path, one to many vectors, tails) and the models' widths
    (896 .. 20000, where the partial-sum levels fold), 1-7 rows; the other vector width is
    wrong somewhere (the order is what the test checks, not a tolerance)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from cascade.models.backends.native import norm_lanes

    lanes = norm_lanes()
    assert lanes in (8, 16)  # found on this machine; 0 would mean the norms run ATen's ops
    ext = native_kernels()
    gen = torch.Generator().manual_seed(6)
    other_differs = False
    for width in [*range(1, 301), 511, 896, 1536, 3584, 8192, 20000]:
        norm = Qwen2RMSNorm(width, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=gen))
        x = torch.randn(1 + width % 7, width, generator=gen) * 3
        with torch.inference_mode():
            assert torch.equal(ext.rms_norm(x, norm.weight, 1e-6, lanes), norm(x)), width
            other_differs |= not torch.equal(ext.rms_norm(x, norm.weight, 1e-6, 24 - lanes), norm(x))
    assert other_differs


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_kernels_multiply_their_dequantized_weights(kind):
    k, n = (256, 70)
    lin = _fp16_linear(k, n, bias=True, seed=5)
    module = {"int8": NativeInt8Linear, "int4": NativeInt4Linear}[kind](lin)
    dense = module.dense_weight()
    w = lin.weight.detach()
    if kind == "int8":  # per channel: |w - deq| <= scale / 2
        assert ((dense - w).abs() <= module.scale[:n, None] / 2 * (1 + 1e-6)).all()
    else:  # per (column, group of 64): |w - deq| <= scale / 2
        groups = w.reshape(n, k // 64, 64).abs().amax(-1) / 7
        assert ((dense - w).abs().reshape(n, k // 64, 64) <= groups[..., None] / 2 * (1 + 1e-5)).all()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ dense.double().T + lin.bias.double()
    tol = 4 * fp32_sum_bound(k) * (x.double().abs() @ dense.double().abs().T) + 1e-6 * ref.abs()
    assert ((module(x).double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("k", [256, 37])
def test_vnni_kernel_is_its_integer_sums(k):
    """int8 x int8: y = (sum (xq - 128) q) * sx * s_w + b with xq = round(x / sx) + 128, sx =
    max|x| / 127 per row, recomputed here exactly (int64 sums) and compared to fp32 rounding."""
    if not _vnni():
        pytest.skip("no AVX-512 VNNI on this CPU")
    n = 70
    lin = _fp16_linear(k, n, bias=True, seed=8)
    module = NativeInt8VNNILinear(lin)
    plain = NativeInt8Linear(lin)
    assert torch.equal(module.dense_weight(), plain.dense_weight())
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(9))
    sx = x.abs().amax(1) / 127
    xq = torch.round(x / sx[:, None]).to(torch.int64)  # [M, K], -127..127
    q = torch.round(plain.dense_weight() / plain.scale[:n, None]).to(torch.int64)  # [N, K]
    ref = (xq @ q.T).double() * sx.double()[:, None] * plain.scale[:n].double() + lin.bias.double()
    assert ((module(x).double() - ref).abs() <= 1e-6 * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("n", [70, 200, 31])
def test_int4_vnni_kernel_is_its_integer_sums(n):
    """int4 x int8: y = sx * sum_g s_g (sum_{k in g} (q_k - 8) xq_k) + b with xq = round(x / sx),
    sx = max|x| / 127 per row, recomputed here (exact integer group sums) and compared to fp32
    rounding; the packing round-trips and the weights are int4_native's. 11 rows: the AVX2
    kernel's two-row passes and its one-row pass over two panels side by side."""
    if _needs("int4_vnni"):
        pytest.skip(_needs("int4_vnni"))
    k = 256
    lin = _fp16_linear(k, n, bias=True, seed=10)
    module, plain = NativeInt4VNNILinear(lin), NativeInt4Linear(lin)
    assert torch.equal(module.dense_weight(), plain.dense_weight())
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4_vnni(pack_int4_vnni(q), n), q)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(11))
    sx = x.abs().amax(1) / 127
    xq = torch.round(x * (1 / sx)[:, None]).clamp(-127, 127).to(torch.int64)  # [M, K]
    w_int = (unpack_int4_vnni(module.packed, n).to(torch.int64) - 8).reshape(n, k // 64, 64)  # [N, G, 64]
    sums = torch.einsum("mgk,ngk->mng", xq.reshape(11, k // 64, 64), w_int).double()  # [M, N, G] exact
    scale = module.scales.permute(0, 2, 1).reshape(-1, k // 64)[:n].double()  # [N, G]
    ref = (sums * scale).sum(-1) * sx.double()[:, None] + lin.bias.double()
    assert ((module(x).double() - ref).abs() <= 1e-5 * ref.abs() + 1e-5).all()
    # and it approximates the fp32 product of the same weights to the activations' rounding
    exact = x.double() @ plain.dense_weight().double().T + lin.bias.double()
    assert (module(x).double() - exact).norm() / exact.norm() < 0.03


@pytest.mark.parametrize("group", [64, 16, 8, 4])
def test_int4_vnni_one_row_is_the_blocked_rows(group):
    """A one-row call runs its own schedule (one panel at a time, the group's integer sums split
    over four accumulators, where the group holds a multiple of 16 k; the blocked path for other
    groups): each row of an 11-row call is bitwise that row alone, and both are the exact integer
    group sums recomputed here, for groups the split divides and groups it does not."""
    if _needs("int4_vnni"):
        pytest.skip(_needs("int4_vnni"))
    k, n = 256, 70
    lin = _fp16_linear(k, n, bias=True, seed=12)
    module = NativeInt4VNNILinear(lin, group=group)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(13))
    together = module(x)
    for i in range(x.shape[0]):
        assert torch.equal(module(x[i : i + 1]), together[i : i + 1]), f"row {i}"
    sx = x.abs().amax(1) / 127
    xq = torch.round(x * (1 / sx)[:, None]).clamp(-127, 127).to(torch.int64)  # [M, K]
    w_int = (unpack_int4_vnni(module.packed, n).to(torch.int64) - 8).reshape(n, k // group, group)
    sums = torch.einsum("mgk,ngk->mng", xq.reshape(11, k // group, group), w_int).double()  # [M, N, G] exact
    scale = module.scales.permute(0, 2, 1).reshape(-1, k // group)[:n].double()  # [N, G]
    ref = (sums * scale).sum(-1) * sx.double()[:, None] + lin.bias.double()
    assert ((module(x[:1]).double() - ref[:1]).abs() <= 1e-5 * ref[:1].abs() + 1e-5).all()


def test_int4_refuses_k_off_the_group():
    with pytest.raises(ValueError, match="divisible by 64"):
        NativeInt4Linear(nn.Linear(100, 32))


def _reference_attention(q, k, v, mask, scaling):  # fp64: [1, H, n, D], [1, Hkv, L, D] -> [1, n, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    s = (q.double() @ k.transpose(-1, -2)) * scaling
    n, L = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.full((n, L), float("-inf")).triu(L - n + 1)[None, None]
    p = torch.softmax(s + mask.double(), dim=-1)
    return (p @ v).transpose(1, 2)


class _Attn(nn.Module):
    scaling = 0.125


def test_attention_matches_reference_and_is_row_invariant():
    gen = torch.Generator().manual_seed(7)
    H, Hkv, D, past, n = 6, 2, 72, 40, 9  # D not a multiple of 16: the tail lanes
    buf_k = torch.randn(1, Hkv, 128, D, generator=gen)  # a cache buffer, read through a strided view
    buf_v = torch.randn(1, Hkv, 128, D, generator=gen)
    keys, values = buf_k[:, :, : past + n], buf_v[:, :, : past + n]
    q = torch.randn(1, n, H, D, generator=gen).transpose(1, 2)  # [1, H, n, D] as transformers passes it
    out, _ = native_attention(_Attn(), q, keys, values, None)
    ref = _reference_attention(q, keys, values, None, 0.125)
    assert (out.double() - ref).abs().max() < 1e-5
    for i in range(n):  # query i alone over the keys it sees == query i inside the n-query call
        one, _ = native_attention(_Attn(), q[:, :, i:i + 1], keys[:, :, : past + i + 1], values[:, :, : past + i + 1], None)
        assert torch.equal(one[:, 0], out[:, i]), i
    # a tree mask: query i sees the past and an arbitrary subset of the block that includes itself
    visible = torch.rand(n, n, generator=gen) < 0.5
    visible |= torch.eye(n, dtype=torch.bool)
    mask = torch.zeros(1, 1, n, past + n)
    mask[0, 0, :, past:] = torch.where(visible, 0.0, float("-inf"))
    tree, _ = native_attention(_Attn(), q, keys, values, mask)
    lowest = mask.clamp(min=torch.finfo(torch.float32).min)  # transformers' way of writing "hidden"
    assert torch.equal(native_attention(_Attn(), q, keys, values, lowest)[0], tree)
    assert (tree.double() - _reference_attention(q, keys, values, mask, 0.125)).abs().max() < 1e-5
    boolean, _ = native_attention(_Attn(), q, keys, values, mask == 0)
    assert torch.equal(boolean, tree)
    for i in range(n):  # the same query over only the keys it sees (in order): bitwise the same
        idx = torch.cat([torch.arange(past), past + visible[i].nonzero()[:, 0]])
        alone, _ = native_attention(_Attn(), q[:, :, i:i + 1], keys[:, :, idx], values[:, :, idx], None)
        assert torch.equal(alone[:, 0], tree[:, i]), i


# ---- the backend on a model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_native():
    """A tiny random Llama whose weights fp16 holds exactly (as the zoo's bf16 checkpoints), on
    the native backend as ``load_model(backend="native")`` sets it up."""
    return _native_tiny(hidden_size=32, num_layers=4)


def _native_tiny(hidden_size: int, num_layers: int):
    from cascade.models.backends.lean import attach_lean
    from cascade.models.tiny import tiny_llama

    lm = tiny_llama(vocab_size=256, hidden_size=hidden_size, num_layers=num_layers, seed=0, dtype=torch.float32,
                    device="cpu", name=f"tiny:0 fp16-exact h{hidden_size}")
    with torch.no_grad():
        for p in lm.model.parameters():
            p.copy_(p.half().float())
    swapped, kept = swap_linears(lm.model, NativeFP16Linear)
    assert kept == [] and swapped == num_layers * 7 + 1
    attach_lean(lm)
    return lm


def test_tiny_model_runs_the_lean_forward(tiny_native):
    from cascade.models.backends.lean import LeanDecoder

    from cascade.models.backends.lean import FusedLayer

    assert isinstance(tiny_native.lean, LeanDecoder)
    assert all(isinstance(layer, FusedLayer) for layer in tiny_native.lean.layers)  # two native calls per layer
    # gate / up (64 columns each) joined; q / k / v not (k's 16 columns are not whole panels): the
    # per-layer ops concatenated instead (the joined path: test_fused_layers_are_bitwise_the_per_op_layers)
    assert all(len(layer.qkv) == 3 and len(layer.gate_up) == 1 for layer in tiny_native.lean.layers)
    assert tiny_native.model.config._attn_implementation == "cascade_native"


@pytest.mark.parametrize("quantize", [None, "int8_native", "int8_vnni", "int4_native", "int4_vnni"])
def test_fused_layers_are_bitwise_the_per_op_layers(quantize):
    """Each kernel kind through the two-call layer (LinearOp) equals the per-op Python layer bit
    for bit: a chain step, a block with hidden states, and a tree-masked forward (a model 64 wide,
    so that int4's groups of 64 fit every layer)."""
    from cascade.models.backends.lean import FusedLayer, LeanDecoder, OpsLayer
    from cascade.models.loading import quantized_copy
    from cascade.tree_structure import tree_mask, tree_positions

    if _needs(quantize):
        pytest.skip(_needs(quantize))
    base = _native_tiny(hidden_size=64, num_layers=2)
    lm = base if quantize is None else quantized_copy(base, quantize)
    fused, ops = lm.lean, LeanDecoder(lm.model, fused_layers=False)
    assert all(isinstance(layer, FusedLayer) for layer in fused.layers)
    assert all(len(layer.qkv) == 1 and len(layer.gate_up) == 1 for layer in fused.layers)  # joined projections
    assert all(isinstance(layer, OpsLayer) for layer in ops.layers)

    def run():
        cache = lm.new_cache()
        first = lm.forward(list(range(3, 30)), cache)
        block, hidden = lm.forward([5, 9, 11, 17], cache, return_hidden=1)
        past = lm.cache_len(cache)
        parents = [-1, 0, 0, 1]
        tree = lm.forward([4, 8, 12, 16, 20], cache, position_ids=tree_positions(parents, past),  # [root] + nodes
                          attention_mask=tree_mask(parents, past))
        return first, block, hidden, tree

    try:
        a = run()
        lm.use_forward(ops)
        b = run()
    finally:
        lm.use_forward(fused)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _both_paths(lm, fn):
    """fn(lm) with the lean forward and with transformers' forward on the same modules."""
    lean = lm.lean
    try:
        a = fn(lm)
        lm.use_forward(None)
        b = fn(lm)
    finally:
        lm.use_forward(lean)
    return a, b


@pytest.mark.parametrize("H, Hkv, D", [(15, 1, 64), (14, 2, 64), (12, 2, 128), (7, 7, 100), (26, 1, 8), (4, 2, 24)])
def test_attention_heads_are_computed_alone(H, Hkv, D):
    """The heads of a key/value group share each value row's loads (blocks of heads, split
    unevenly where the group does not divide): every head's output is still bitwise that head's
    own one-head call, with and without a tree mask, over a strided cache view."""
    gen = torch.Generator().manual_seed(H * 100 + D)
    past, n = 37, 5
    buf_k, buf_v = (torch.randn(1, Hkv, 64, D, generator=gen) for _ in range(2))
    keys, values = buf_k[:, :, : past + n], buf_v[:, :, : past + n]
    q = torch.randn(1, n, H, D, generator=gen).transpose(1, 2)  # [1, H, n, D]
    mask = torch.zeros(1, 1, n, past + n)
    mask[0, 0, :, past:] = torch.triu(torch.full((n, n), float("-inf")), 1)
    mask[0, 0, 3, past + 1] = float("-inf")  # a tree: node 3 does not see node 1
    for m in (None, mask):
        out, _ = native_attention(_Attn(), q, keys, values, m)  # [1, n, H, D]
        assert (out.double() - _reference_attention(q, keys, values, m, 0.125)).abs().max() < 1e-5
        group = H // Hkv
        for h in range(H):
            g = h // group
            one, _ = native_attention(_Attn(), q[:, h:h + 1], keys[:, g:g + 1], values[:, g:g + 1], m)
            assert torch.equal(one[:, :, 0], out[:, :, h]), (h, m is None)


def test_trained_modules_copied_from_a_native_target_keep_a_differentiable_attention(tiny_native):
    """The native attention has no backward: a draft head or exit adapter copied from a target on
    the native backend must run transformers' attention, or training would silently get no
    gradient through it."""
    from cascade.models.heads.adapter import ExitAdapter
    from cascade.models.heads.eagle import DraftHead

    head = DraftHead.from_target(tiny_native)
    adapter = ExitAdapter.from_target(tiny_native, 2)
    assert head.config._attn_implementation == adapter.config._attn_implementation == "sdpa"
    head.for_inference(tiny_native)  # at inference the head's linears join the target's kernel
    assert isinstance(head.fc, NativeFP16Linear)
    assert tiny_native.model.config._attn_implementation == "cascade_native"  # the target's own is untouched


def test_lean_forward_is_bitwise_transformers_forward(tiny_native):
    from cascade.models.lm import FINAL_HIDDEN
    from cascade.tree_structure import tree_mask, tree_positions

    prompt, block = list(range(3, 40)), [5, 9, 11, 200, 17, 30]

    def chain(lm):
        cache = lm.new_cache()
        first = lm.forward(prompt, cache)
        logits, hidden = lm.forward(block, cache, return_hidden=2)
        _, final = lm.forward([7], cache, return_hidden=FINAL_HIDDEN)
        _, three = lm.forward([8, 9], cache, return_hidden=(1, 2, 2))  # EAGLE-3's captured layers, concatenated
        assert three.shape == (2, 3 * lm.model.config.hidden_size)
        return first, logits, hidden, final, three, lm.cache_len(cache)

    for a, b in zip(*_both_paths(tiny_native, chain)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))

    parents = [-1, 0, 0, 1, 1, 2]  # a tree of six nodes under the root (block[0]), verified in one forward then compacted

    def tree(lm):
        cache = lm.new_cache()
        lm.forward(prompt, cache)
        past = lm.cache_len(cache)
        tokens = block + [23]  # [root] + nodes
        logits = lm.forward(tokens, cache, position_ids=tree_positions(parents, past), attention_mask=tree_mask(parents, past))
        lm.compact(cache, past, [0, 1, 3, 6])
        after = lm.forward([19], cache)
        return logits, after

    for a, b in zip(*_both_paths(tiny_native, tree)):
        assert torch.equal(a, b)


def test_lean_forward_on_a_transformers_cache_is_bitwise_the_preallocated_one(tiny_native):
    """On cascade's preallocated cache the decoder is one native call whose layers write keys and
    values into the cache's buffers; on any other cache (transformers' own DynamicCache) each
    layer runs around the layer's update instead: the same logits bit for bit, chain and tree,
    and the same cache contents."""
    from transformers import DynamicCache

    from cascade.tree_structure import tree_mask, tree_positions

    def run(cache):
        first = tiny_native.forward(list(range(3, 40)), cache)
        past = tiny_native.cache_len(cache)
        parents = [-1, 0, 0, 1]
        tree = tiny_native.forward([4, 8, 12, 16, 20], cache, position_ids=tree_positions(parents, past),  # [root] + nodes
                                   attention_mask=tree_mask(parents, past))
        return first, tree, cache.layers[-1].keys, cache.layers[-1].values

    plain = DynamicCache()
    assert not isinstance(plain.layers[0] if plain.layers else None, type(tiny_native.new_cache().layers[0]))
    # cascade's cache runs the whole decoder as one native call, transformers' layer by layer
    assert tiny_native.lean._one_call(tiny_native.new_cache()) and not tiny_native.lean._one_call(plain)
    for a, b in zip(run(tiny_native.new_cache()), run(plain)):
        assert torch.equal(a, b)


def test_pruned_head_on_the_native_backend(tiny_native):
    """FR-Spec's pruned LM head on a native model: the kept rows on the same kernel (bitwise the
    full head's logits there), -inf elsewhere, and the pruned model keeps the lean forward."""
    from cascade.models.heads.pruned_head import prune_head

    keep = torch.tensor([3, 17, 40, 41, 200])
    pruned = prune_head(tiny_native, keep)
    assert pruned.lean is not None and pruned.lean.head is pruned.model.get_output_embeddings()
    ids = list(range(5, 30))
    full = tiny_native.forward(ids, tiny_native.new_cache())
    cut = pruned.forward(ids, pruned.new_cache())
    kept = sorted(set(keep.tolist()) | tiny_native.eos_token_ids)
    assert torch.equal(cut[:, kept], full[:, kept])
    others = [i for i in range(tiny_native.vocab_size) if i not in kept]
    assert torch.isinf(cut[:, others]).all()


def test_k_token_forward_is_k_single_steps_bitwise(tiny_native):
    """The whole forward on the native backend is row-invariant: a verification forward over k
    tokens gives bitwise the logits of k one-token steps (k = 2..16)."""
    lm = tiny_native
    cache = lm.new_cache()
    lm.forward(list(range(10, 60)), cache)
    past = lm.cache_len(cache)
    block = [(37 * i + 11) % 256 for i in range(16)]
    singles = torch.cat([lm.forward([t], cache) for t in block])
    for k in range(2, 17):
        lm.crop(cache, past)
        assert torch.equal(lm.forward(block[:k], cache), singles[:k]), k


def test_cache_grows_crops_and_compacts_like_transformers():
    from transformers.cache_utils import DynamicLayer

    from cascade.models.kv_cache import INITIAL_CAPACITY, PreallocatedLayer
    from cascade.models.lm import CausalLM

    gen = torch.Generator().manual_seed(4)
    pre, dyn = PreallocatedLayer(), DynamicLayer()
    for n in (100, INITIAL_CAPACITY, 3, 70):  # grows twice
        k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
        for layer in (pre, dyn):
            layer.update(k, v)
    assert torch.equal(pre.keys, dyn.keys) and torch.equal(pre.values, dyn.values)
    pre.crop(-50), dyn.crop(-50)
    assert pre.get_seq_length() == dyn.get_seq_length() == 100 + INITIAL_CAPACITY + 3 + 20
    assert torch.equal(pre.keys, dyn.keys)

    class Holder:
        layers = [pre, dyn]

    past = pre.get_seq_length() - 10
    CausalLM.compact(Holder, past, [1, 4, 9])
    assert pre.get_seq_length() == dyn.get_seq_length() == past + 3
    assert torch.equal(pre.keys, dyn.keys) and torch.equal(pre.values, dyn.values)


def test_greedy_speculation_equals_autoregressive_on_the_backend(tiny_native):
    from cascade import generate
    from cascade.cascades import VerticalCascade
    from cascade.drafters import NGramDrafter, QuantizedLMDrafter, SmallLMDrafter
    from cascade.drafters.draft_head import DraftHeadDrafter
    from cascade.trees.drafter import TreeDrafter
    from cascade.trees import DynamicTreePolicy, StaticTreePolicy

    lm = tiny_native
    prompt = [1, 5, 9, 14, 5, 9, 14, 5, 9]
    ar = generate(lm, prompt, drafter=None, max_new_tokens=40).tokens
    drafters = {
        "chain": lambda: SmallLMDrafter(lm, k=5),
        "int8 native": lambda: QuantizedLMDrafter(lm, "int8_native", k=4),
        "int8 vnni": lambda: QuantizedLMDrafter(lm, "int8_vnni" if _vnni() else "int8_native", k=4),
        "int4 native": lambda: QuantizedLMDrafter(lm, "int4_native", k=3) if lm.model.config.hidden_size % 64 == 0
        else QuantizedLMDrafter(lm, "int8_native", k=3),
        "int4 vnni": lambda: QuantizedLMDrafter(lm, "int4_vnni", k=3) if lm.model.config.hidden_size % 64 == 0 and _int8_dot()
        else QuantizedLMDrafter(lm, "int8_native", k=3),
        "cascade": lambda: VerticalCascade([SmallLMDrafter(lm, k=5), NGramDrafter(k=2)]),
        "draft head": lambda: DraftHeadDrafter("init", k=3),
        "static tree": lambda: TreeDrafter([SmallLMDrafter(lm)], StaticTreePolicy((2, 2, 1))),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(lm), NGramDrafter(k=1)],
                                    DynamicTreePolicy(t_min=0.02, max_nodes=12, max_depth=4, max_rank=2,
                                                      prior_drafter_cost=0.05, measure_costs=False)),
    }
    for name, make in drafters.items():
        out = generate(lm, prompt, drafter=make(), max_new_tokens=40)
        assert out.tokens == ar, name
        if name != "draft head":  # (an untrained head is rarely right: it runs, the target corrects it)
            assert sum(s.accepted for s in out.steps) > 0, name  # the drafts were used, not all rejected


def test_disabled_extension_falls_back_to_fbgemm():
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from cascade.models.backends.backend import auto_backend\n"
        "from cascade.models.loading import load_model\n"
        "from cascade.models.backends.cpu_kernels import fbgemm_available\n"
        "from cascade.models.backends.native import native_kernels, unavailable_reason\n"
        "assert native_kernels() is None and 'CASCADE_NATIVE=0' in unavailable_reason()\n"
        "expected = 'fp16w' if fbgemm_available() else None\n"
        "got = auto_backend(torch.device('cpu')).name\n"
        "assert expected is None or got == expected, got\n"
        "from cascade.models.backends.quantize import resolve_method\n"
        "assert resolve_method('auto', torch.device('cpu')) == 'int8_dynamic'\n"
        "try:\n"
        "    load_model('tiny:0', backend='native')\n"
        "except RuntimeError as exc:\n"
        "    assert 'unavailable' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('dtype=native loaded without the extension')\n"
        "lm = load_model('tiny:0', backend='auto')\n"
        "print('fallback', got, type(lm.model.lm_head).__name__)\n"
    )
    env = dict(os.environ, CASCADE_NATIVE="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fallback" in proc.stdout
    assert "native kernels are unavailable (disabled by CASCADE_NATIVE=0)" in proc.stderr


def _native_copy(lm, name):
    """``lm`` in fp32 with fp16-exact weights on the native backend (a copy; ``lm`` is untouched)."""
    import copy

    from cascade.models import CausalLM
    from cascade.models.backends.lean import attach_lean

    model = copy.deepcopy(lm.model).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    native = CausalLM(model, None, name)
    swap_linears(native.model, NativeFP16Linear)
    attach_lean(native)
    return native


@pytest.mark.parametrize("method,setting", [("chain", "temperature"), ("static_tree", "top_p")])
def test_sampled_speculation_on_the_backend_is_lossless(method, setting):
    """Deep drafts sampled through the native kernels (fp32): the law of 6 tokens against the
    exact law of a stock fp32 copy of the same fp16-exact weights (the deep suite's reference,
    tests/deep_stats.py), with accepts and rejections at every depth."""
    from deep_stats import LEVEL, exact_law, lossless_pvalue, sample_outputs
    from test_lossless_deep import L, PROMPT, SETTINGS, damped

    from cascade.drafters import SmallLMDrafter
    from cascade.models import perturbed_copy
    from cascade.trees.drafter import TreeDrafter
    from cascade.trees import StaticTreePolicy

    base = damped()
    stock = base.model.float()
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(p.half().float())
    target = _native_copy(base, "damped native")
    close = _native_copy(perturbed_copy(base, 0.35, seed=3), "close native")
    assert target.lean is not None and target.model.config._attn_implementation == "cascade_native"
    make = {"chain": lambda: SmallLMDrafter(close, k=5),
            "static_tree": lambda: TreeDrafter([SmallLMDrafter(close)], StaticTreePolicy((2, 2, 1, 1)))}[method]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = sample_outputs(target, make, PROMPT, L, 1000, 0, SETTINGS[setting])
    finally:
        torch.set_num_threads(threads)
    p = lossless_pvalue(samples, exact_law(stock, PROMPT, L, **SETTINGS[setting]))
    report = f"{method}/{setting} on native: p={p:.2g}; {samples.depth_report()}"
    assert samples.exercised(4, 20), report
    assert p > LEVEL, report


# ---- every tensor argument of every native op is checked ------------------------------------------

def _wrong(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` on another device (meta), of another dtype, or with a non-unit inner stride."""
    if what == "device":
        return torch.empty_like(t, device="meta")
    if what == "dtype":
        return t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]  # the same values, stride 2 along the last dimension


def _linear_ops():
    """(op name, kernel call taking keyword tensors, its tensor arguments) for each linear kind here."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True)
    lin.weight.data = lin.weight.data.half().float()
    ext = native_kernels()
    x = torch.randn(3, 64)
    cases = []
    for cls, op in [(NativeFP16Linear, "linear_fp16"), (NativeInt8Linear, "linear_int8"), (NativeInt4Linear, "linear_int4"),
                    (NativeInt8VNNILinear, "linear_int8_vnni"), (NativeInt4VNNILinear, "linear_int4_vnni")]:
        if op == "linear_int8_vnni" and not _vnni():
            continue
        if op == "linear_int4_vnni" and not _int8_dot():
            continue
        m = cls(lin)
        f = m.op_fields()
        tensors = {"x": x, "packed": f["packed"], "bias": f["bias"]}
        tensors.update({k: f[k] for k in ("scale", "colsum") if f.get(k) is not None})
        if op in ("linear_int4", "linear_int4_vnni"):
            tensors["scales"] = tensors.pop("scale")

        def call(op=op, f=f, **t):
            fn = getattr(ext, op)
            if op == "linear_fp16":
                return fn(t["x"], t["packed"], f["N"], t["bias"])
            if op == "linear_int8":
                return fn(t["x"], t["packed"], t["scale"], f["N"], t["bias"])
            if op == "linear_int8_vnni":
                return fn(t["x"], t["packed"], t["colsum"], t["scale"], f["N"], t["bias"])
            return fn(t["x"], t["packed"], t["scales"], f["group"], f["N"], t["bias"])

        cases.append((op, call, tensors))
    return cases


def _other_ops():
    ext = native_kernels()
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    mask = torch.zeros(1, 1, 3, 5)
    x4, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    g, u = torch.randn(3, 10), torch.randn(3, 10)
    return [
        ("attention", lambda **t: ext.attention(t["q"], t["k"], t["v"], t["mask"], 0.25), dict(q=q, k=k, v=v, mask=mask)),
        ("rope", lambda **t: ext.rope(t["x"], t["cos"], t["sin"]), dict(x=x4, cos=cos, sin=sin)),
        ("silu_mul", lambda **t: ext.silu_mul(t["gate"], t["up"]), dict(gate=g, up=u)),
    ]


# which arguments a kernel reads through strides of its own (any layout is fine there)
_ANY_LAYOUT = {("attention", "mask"), ("rope", "cos"), ("rope", "sin"), ("silu_mul", "gate")}


def test_every_native_op_checks_device_dtype_and_layout_of_every_tensor():
    checked = 0
    for op, call, tensors in _linear_ops() + _other_ops():
        call(**tensors)  # the right arguments run
        for name, t in tensors.items():
            for what in ("device", "dtype", "layout"):
                if what == "layout" and ((op, name) in _ANY_LAYOUT or t.shape[-1] == 1):
                    continue
                bad = {**tensors, name: _wrong(t, what)}
                with pytest.raises(RuntimeError, match=f"{op}: {name} (must|needs)"):
                    call(**bad)
                checked += 1
    assert checked >= 40


def test_rms_norm_refuses_a_tensor_off_the_cpu():
    ext = native_kernels()
    x, w = torch.randn(2, 16), torch.ones(16)
    for bad in ({"x": x.to("meta"), "w": w}, {"x": x, "w": w.to("meta")}):
        with pytest.raises(RuntimeError, match="rms_norm: x and weight must be on the CPU"):
            ext.rms_norm(bad["x"], bad["w"], 1e-6, 16)


def test_a_query_with_every_key_masked_is_an_error_not_nan():
    ext = native_kernels()
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    for D in (16, 160):  # the wide kernel (D <= 128 on AVX-512) and the general one
        q, k, v = torch.randn(1, 4, 3, D), torch.randn(1, 2, 5, D), torch.randn(1, 2, 5, D)
        mask = torch.zeros(1, 1, 3, 5)
        mask[0, 0, 1] = float("-inf")
        with pytest.raises(RuntimeError, match="attention: query 1 of batch row 0 has every key masked"):
            ext.attention(q, k, v, mask, 0.25)
        mask[0, 0, 1] = torch.finfo(torch.float32).min  # transformers' way of writing a hidden key
        with pytest.raises(RuntimeError, match="every key masked"):
            ext.attention(q, k, v, mask, 0.25)
        mask[0, 0, 1, 4] = 0.0
        assert not ext.attention(q, k, v, mask, 0.25).isnan().any()


def test_stream_read_reads_every_byte():
    """The bandwidth probe's streaming read folds every byte it reads (so none can be skipped):
    over whole 256-byte steps its result is the XOR of the buffer's 64-bit words."""
    import numpy as np

    ext = native_kernels()
    gen = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (1 << 21,), dtype=torch.uint8, generator=gen)  # two 1 MiB thread ranges
    want = int(np.bitwise_xor.reduce(buf.numpy().view(np.uint64)))
    assert ext.stream_read(buf) & (2**64 - 1) == want
    assert ext.stream_read(buf, True) & (2**64 - 1) == want  # prefetching into L2: the same bytes
    flipped = buf.clone()
    flipped[12345] ^= 0x10  # one bit of one byte anywhere changes the result
    assert ext.stream_read(flipped) != ext.stream_read(buf)
    for bad, said in ((buf.float(), "must be Byte"), (buf[::2], "must be contiguous"), (buf.to("meta"), "must be on the CPU")):
        with pytest.raises(RuntimeError, match=f"stream_read: buffer {said}"):
            ext.stream_read(bad)
