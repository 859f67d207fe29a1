"""The gguf backend: GGUF block formats on native kernels (csrc/gguf.cpp), weights bitwise the
`gguf` package's reference dequantization, fp32 sums within their bound, row-invariant; tiny
GGUF files through the lean forward, equal to a float64 model of the reference weights, and
every method's greedy output equal to autoregressive decoding on them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from cascade import generate
from cascade.models.backends.native import fp32_sum_bound, native_kernels

from gguf_files import K_QUANTS, LEGACY, random_blocks, reference_model, tiny_gguf_target

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="cascade's native kernels do not build here")
FORMATS = [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]


def _ext():
    return native_kernels()


def _path_runs_here(path: str) -> bool:
    """Whether this CPU runs a kernel path: avx512 / avx2 / scalar (linear_gguf, dequantize_gguf),
    avx512_vnni / avx2 / scalar (linear_gguf_q8)."""
    return {"avx512_vnni": _ext().has_vnni(), "avx512": _ext().isa() == "avx512", "avx2": _ext().isa() != "none",
            "scalar": True}[path]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_weights_are_bitwise_the_gguf_reference(qtype, path):
    """Every decode this CPU runs (the AVX-512 and AVX2 kernels', the scalar one) gives the reference's bits."""
    if not _path_runs_here(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    rng = np.random.default_rng(int(qtype))
    k = 2 * gguf.GGML_QUANT_SIZES[qtype][0] * (4 if qtype in (T.Q4_1, T.Q5_0, T.Q8_0) else 1)
    blocks = random_blocks(qtype, 41, k, rng)
    expected = gguf.quants.dequantize(blocks, qtype)
    got = _ext().dequantize_gguf(torch.from_numpy(blocks), int(qtype), k, path=path).numpy()
    assert np.array_equal(_bits(got), _bits(expected))
    rows = torch.tensor([40, 0, 7, 7])  # a row subset, repeated, out of order (the embedding's lookup)
    sub = _ext().dequantize_gguf(torch.from_numpy(blocks), int(qtype), k, rows=rows, path=path).numpy()
    assert np.array_equal(_bits(sub), _bits(expected[rows.numpy()]))


def test_every_fp16_scale_converts_exactly():
    """Q8_0 blocks whose scale runs through every finite fp16 (subnormals, zeros of both signs)
    with codes -128, -1, 1, 127: the decode's fp16 conversion is exact."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]
    blocks = np.zeros((len(halves), 34), dtype=np.uint8)
    blocks[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = np.array([-128, -1, 1, 127] * 8, dtype=np.int8).view(np.uint8)
    expected = gguf.quants.dequantize(blocks, T.Q8_0)
    for path in filter(_path_runs_here, ("avx512", "avx2", "scalar")):
        got = _ext().dequantize_gguf(torch.from_numpy(blocks), int(T.Q8_0), 32, path=path).numpy()
        assert np.array_equal(_bits(got), _bits(expected))


def _shape(qtype):
    qk = gguf.GGML_QUANT_SIZES[qtype][0]
    return (3 * qk if qk == 256 else 7 * qk), 37  # K (odd count of blocks), N (odd)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_products_within_the_fp32_bound_and_row_invariant(qtype, path):
    if not _path_runs_here(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    rng = np.random.default_rng(100 + int(qtype))
    k, n = _shape(qtype)
    blocks = random_blocks(qtype, n, k, rng)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(2))
    y = _ext().linear_gguf(x, torch.from_numpy(blocks), int(qtype), n, bias, path=path)
    exact = x.double() @ w.T + bias.double()
    bound = fp32_sum_bound(k + 1) * ((x.double().abs() @ w.abs().T) + bias.double().abs())
    assert ((y.double() - exact).abs() <= bound).all()
    for m in range(1, 33):  # row i of an m-row call is bitwise the 1-row call
        part = _ext().linear_gguf(x[:m], torch.from_numpy(blocks), int(qtype), n, bias, path=path)
        assert torch.equal(part, y[:m]), m
    wide = torch.zeros(6, k + 5)  # rows k + 5 apart: read through the row stride
    wide[:, :k] = x[3:9]
    assert torch.equal(_ext().linear_gguf(wide[:, :k], torch.from_numpy(blocks), int(qtype), n, bias, path=path), y[3:9])


def test_errors_name_the_problem():
    blocks = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="block type 10 has no native kernel"):
        _ext().linear_gguf(torch.zeros(1, 32), blocks, 10, 4)
    with pytest.raises(RuntimeError, match="a row of K = 64 weights is 68 bytes"):
        _ext().linear_gguf(torch.zeros(1, 64), blocks, int(T.Q8_0), 4)
    with pytest.raises(RuntimeError, match="not a whole number of 256-weight blocks"):
        _ext().linear_gguf(torch.zeros(1, 32), blocks, int(T.Q4_K), 4)
    with pytest.raises(RuntimeError, match="x must be Float"):
        _ext().linear_gguf(torch.zeros(1, 32, dtype=torch.float64), blocks, int(T.Q8_0), 4)
    with pytest.raises(RuntimeError, match="outside"):
        _ext().dequantize_gguf(blocks, int(T.Q8_0), 32, rows=torch.tensor([4]))
    with pytest.raises(RuntimeError, match="unknown path 'scalar'"):  # no scalar product kernel
        _ext().linear_gguf(torch.zeros(1, 32), torch.zeros(4, 34, dtype=torch.uint8), int(T.Q8_0), 4, path="scalar")
    with pytest.raises(RuntimeError, match="unknown path 'avx3'"):
        _ext().dequantize_gguf(blocks, int(T.Q8_0), 32, path="avx3")


# ---- tiny GGUF models ----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["legacy", "k_quants", "k_quants_q8"])
def tiny_gguf(request, tmp_path_factory):
    types, hidden = (LEGACY, 64) if request.param == "legacy" else (K_QUANTS, 256)
    return tiny_gguf_target(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", types, hidden,
                            int8_activations=request.param.endswith("q8"))


def test_tiny_gguf_logits_match_the_reference_weights(tiny_gguf):
    from cascade.models.backends.gguf_weights import NativeGGUFLinear
    from cascade.models.backends.lean import LeanDecoder

    from cascade.models.backends.gguf_weights import NativeGGUFQ8Linear

    lm, file = tiny_gguf
    assert isinstance(lm.lean, LeanDecoder)
    assert isinstance(lm.model.lm_head, NativeGGUFLinear)
    ids = torch.tensor([[3, 17, 99, 4, 250, 8, 8, 1]])
    ours = lm.model(ids).logits.double()
    ref = reference_model(lm, file).model(ids).logits
    if lm.backend.name == "gguf_q8":  # int8 activations: near the file's real-valued model, not equal to it
        assert isinstance(lm.model.lm_head, NativeGGUFQ8Linear)
        assert (ours - ref).abs().max() <= 0.05 * ref.abs().max(), (ours - ref).abs().max()
    else:  # fp32 against float64: each logit within 1e-4 of itself plus 1e-5 of its position's largest
        # logit (an fp32 forward's rounding is relative to the sums' scale, not to a logit that cancels
        # to near zero: one logit of 1.28 in a row whose largest is 2,284 is off by 3e-4 on AVX2's
        # 8-lane order, 3e-7 of the row's scale, a few fp32 ulps of it)
        scale = ref.abs().amax(dim=-1, keepdim=True)
        error = (ours - ref).abs()
        assert (error <= 1e-4 * ref.abs() + 1e-5 * scale).all(), (error / scale).max()


def test_every_method_is_greedy_autoregressive_on_a_gguf_target(tiny_gguf):
    from golden import tiny_methods

    from cascade.models import perturbed_copy

    lm, _ = tiny_gguf
    close = perturbed_copy(reference_model(lm, tiny_gguf[1]), noise=0.02, seed=1)
    prompt = [1, 2, 3, 4, 5, 6]
    ar = generate(lm, prompt, max_new_tokens=24, stop_on_eos=False).tokens
    for name, make in tiny_methods(lm, close).items():
        assert generate(lm, prompt, drafter=make(), max_new_tokens=24, stop_on_eos=False).tokens == ar, name


def test_the_file_and_the_model_must_match(tmp_path):
    from cascade.models import tiny_llama
    from cascade.models.backends.gguf_weights import use_gguf_weights

    _, file = tiny_gguf_target(tmp_path / "t.gguf", LEGACY, 64)
    other = tiny_llama(vocab_size=256, hidden_size=64, num_layers=5, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="no tensor 'blk.4.attn_q.weight'"):
        use_gguf_weights(other.model, file)
    with pytest.raises(ValueError, match="needs a zoo model"):
        from cascade.models import load_model

        load_model("tiny:0", backend="gguf")


# ---- a real file ----------------------------------------------------------------------------------

@pytest.mark.real
def test_smollm2_file_on_the_gguf_backend():
    """SmolLM2-135M's own Q4_1 / Q8_0 file (a Llama: q / k rows permuted in the file, the LM head
    tied to the embedding): every linear's weights equal transformers' load of the same file
    to the bf16 copy's rounding, and greedy speculative output equals autoregressive output
    exactly (no near-tie allowance: the kernels are row-invariant)."""
    from cascade.data import BUILTIN, encode_prompt
    from cascade.drafters import NGramDrafter, SmallLMDrafter
    from cascade.models import load_model
    from cascade.models.backends.gguf_weights import NativeGGUFLinear

    target = load_model("smollm2-135m", backend="gguf")
    assert target.backend.name == "gguf"
    copy = load_model("smollm2-135m", backend="float32")
    ours = dict(target.model.named_modules())
    checked = 0
    for name, module in copy.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert isinstance(ours[name], NativeGGUFLinear), name
            w, w16 = ours[name].dense_weight(), module.weight.detach()
            assert torch.equal(w.bfloat16().float(), w16), name  # the bf16 copy is these weights rounded
            checked += 1
    assert checked == 30 * 7 + 1
    drafter_lm = load_model("smollm2-135m", backend="bfloat16")
    for drafter in (SmallLMDrafter(drafter_lm, k=4), NGramDrafter(k=6, max_ngram=3)):
        for prompt in BUILTIN[:3]:
            ids = encode_prompt(target, prompt.text)
            assert generate(target, ids, drafter=drafter, max_new_tokens=24).tokens == generate(target, ids, max_new_tokens=24).tokens


def test_llamacpp_methods_say_how_to_build_the_server(monkeypatch, tmp_path):
    from cascade.llamacpp import LlamaCppGenerate, LlamaCppUnavailable

    monkeypatch.setenv("CASCADE_LLAMA_SERVER", str(tmp_path / "missing" / "llama-server"))
    with pytest.raises(LlamaCppUnavailable, match="scripts/build_llamacpp.sh"):
        LlamaCppGenerate("qwen2.5-coder-1.5b")


# ---- int8 activations (gguf_q8) -------------------------------------------------------------------

def _q8_reference(x: np.ndarray, blocks: np.ndarray, qtype, bias: np.ndarray | None) -> np.ndarray:
    """The gguf_q8 arithmetic written from its definition (csrc/gguf_q8.cpp's header) with the
    gguf package's block layouts: activations per 256 to int8, integer sums, then fp32 products
    and differences one operation at a time, blocks summed in order."""
    f32 = np.float32
    m_rows, k = x.shape
    n = blocks.shape[0]
    nb = k // 256
    per_block = blocks.reshape(n, nb, -1)
    y = np.zeros((m_rows, n), dtype=f32)
    for m in range(m_rows):
        acc = np.zeros(n, dtype=f32)
        for b in range(nb):
            xb = x[m, 256 * b:256 * (b + 1)].astype(f32)
            amax = f32(np.max(np.abs(xb)))
            if amax == 0:
                xq, dx = np.zeros(256, dtype=np.int64), f32(0)
            else:
                inv, dx = f32(127) / amax, amax / f32(127)
                xq = np.clip(np.rint(xb * inv), -127, 127).astype(np.int64)
            blk = per_block[:, b]
            if qtype == T.Q4_K:
                d = blk[:, 0:2].copy().view(np.float16).astype(f32)[:, 0]
                dmin = blk[:, 2:4].copy().view(np.float16).astype(f32)[:, 0]
                sc, mn = gguf.quants.Q4_K.get_scale_min(blk[:, 4:16].copy())
                qs = blk[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
                codes = (qs & 0xF).reshape(n, 8, 32).astype(np.int64)
                dots = (codes * xq.reshape(1, 8, 32)).sum(-1)  # [n, 8]
                big_i = (sc.astype(np.int64) * dots).sum(-1)
                big_m = (mn.astype(np.int64) * xq.reshape(8, 32).sum(-1)).sum(-1)
                t1 = (d * dx) * big_i.astype(f32)
                t2 = (dmin * dx) * big_m.astype(f32)
                acc = acc + (t1 - t2)
            else:
                ql, qh = blk[:, :128], blk[:, 128:192]
                sc = blk[:, 192:208].copy().view(np.int8).astype(np.int64)
                d = blk[:, 208:210].copy().view(np.float16).astype(f32)[:, 0]
                low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
                high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
                codes = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).reshape(n, 16, 16).astype(np.int64)
                dots = (codes * xq.reshape(1, 16, 16)).sum(-1) - 32 * xq.reshape(16, 16).sum(-1)
                big_i = (sc * dots).sum(-1)
                acc = acc + (d * dx) * big_i.astype(f32)
        y[m] = acc if bias is None else acc + bias
    return y


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["avx512_vnni", "avx2", "scalar"])
def test_int8_activation_kernel_is_bitwise_its_integer_reference(qtype, path):
    """Every path this CPU runs (AVX-512 VNNI, AVX2 maddubs, scalar) gives the integer reference's bits."""
    if not _path_runs_here(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    rng = np.random.default_rng(7 + int(qtype))
    k, n = 3 * 256, 37
    blocks = random_blocks(qtype, n, k, rng)
    x = rng.normal(0, 1, size=(32, k)).astype(np.float32)
    x[5, :256] = 0.0  # an all-zero block
    bias = rng.normal(0, 1, size=n).astype(np.float32)
    y = _ext().linear_gguf_q8(torch.from_numpy(x), torch.from_numpy(blocks), int(qtype), n, torch.from_numpy(bias),
                              path=path).numpy()
    assert np.array_equal(_bits(y), _bits(_q8_reference(x, blocks, qtype, bias)))
    for m in range(1, 33):  # row invariance
        part = _ext().linear_gguf_q8(torch.from_numpy(x[:m]), torch.from_numpy(blocks), int(qtype), n, torch.from_numpy(bias),
                                     path=path)
        assert torch.equal(part, torch.from_numpy(y[:m])), m
    exact = x.astype(np.float64) @ gguf.quants.dequantize(blocks, qtype).astype(np.float64).T + bias
    assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations: close to, not equal to, the exact sums


def test_int8_activations_only_for_k_quants():
    with pytest.raises(RuntimeError, match="no int8-activation kernel"):
        _ext().linear_gguf_q8(torch.zeros(1, 32), torch.zeros(4, 34, dtype=torch.uint8), int(T.Q8_0), 4)
    with pytest.raises(RuntimeError, match="unknown path 'avx3'"):
        _ext().linear_gguf_q8(torch.zeros(1, 256), torch.zeros(4, 144, dtype=torch.uint8), int(T.Q4_K), 4, path="avx3")
    assert _ext().gguf_q8_isa() in {"avx512_vnni", "avx2", "scalar"}


def test_a_run_with_llamacpp_methods_fails_before_loading_when_the_server_is_missing(monkeypatch, tmp_path, no_model_loading):
    from test_validation import _cfg

    from cascade.run import ConfigError, validate

    monkeypatch.setenv("CASCADE_LLAMA_SERVER", str(tmp_path / "missing" / "llama-server"))
    with pytest.raises(ConfigError, match="llamacpp_ar.*build_llamacpp.sh"):
        validate(_cfg("+experiment=bench/gguf"))
