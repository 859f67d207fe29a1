"""The CausalLM wrapper: explicit positions, 4D masks on top of the cache, cropping."""

import pytest
import torch

from cascade.models import load_model, tiny_llama


def _sequential_last_logits(lm, tokens):
    return lm.forward(tokens, lm.new_cache())[-1]


def test_forward_with_positions_and_4d_mask_matches_sequential(tiny_target):
    lm = tiny_target
    prefix = [3, 1, 4, 1, 5]
    cache = lm.new_cache()
    lm.forward(prefix, cache)
    # Two siblings after the prefix (both children of the last prefix token), then a child of
    # the first sibling: tokens [a, b, c], parents [-, -, a], depths [0, 0, 1].
    new = [9, 2, 6]
    allowed = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)  # [n, n] tree part
    n, past = len(new), len(prefix)
    mask = torch.zeros(1, 1, n, past + n, dtype=lm.dtype)
    mask[0, 0, :, past:] = torch.where(allowed, 0.0, float("-inf"))
    logits = lm.forward(new, cache, position_ids=torch.tensor([past, past, past + 1]), attention_mask=mask)
    for row, path in enumerate([[9], [2], [9, 6]]):
        torch.testing.assert_close(logits[row], _sequential_last_logits(lm, prefix + path), atol=1e-9, rtol=0)


def test_crop_then_continue_equals_fresh_cache(tiny_target):
    lm = tiny_target
    cache = lm.new_cache()
    lm.forward([1, 2, 3, 4, 5, 6, 7], cache)
    lm.crop(cache, 4)
    assert lm.cache_len(cache) == 4
    got = lm.forward([8, 9], cache)
    fresh = lm.forward([1, 2, 3, 4, 8, 9], lm.new_cache())[-2:]
    torch.testing.assert_close(got, fresh, atol=1e-12, rtol=0)


def test_keep_last_skips_all_but_the_last_positions(tiny_target):
    out = tiny_target.forward([1, 2, 3], tiny_target.new_cache(), keep_last=1)
    assert out.shape == (1, tiny_target.vocab_size)


def test_tiny_models_are_reproducible():
    a, b = tiny_llama(seed=3), tiny_llama(seed=3)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.dtype == torch.float64 and a.vocab_size == 64


def test_onednn_linears_match_dense_and_keep_greedy_equality():
    from cascade import generate
    from cascade.drafters import NGramDrafter
    from cascade.models.backends.cpu_kernels import OneDNNLinear, use_onednn_linears

    dense = tiny_llama(vocab_size=64, seed=4, dtype="float32")
    fast = tiny_llama(vocab_size=64, seed=4, dtype="float32")
    assert use_onednn_linears(fast.model) > 0
    assert isinstance(fast.model.lm_head, OneDNNLinear) and fast.vocab_size == 64
    ids = [5, 9, 2, 7, 7, 1]
    torch.testing.assert_close(fast.forward(ids, fast.new_cache()), dense.forward(ids, dense.new_cache()), atol=1e-4, rtol=1e-4)
    for prompt in ([1, 2, 3], [4, 4, 4, 4], [9, 8, 7, 9, 8]):
        ar = generate(fast, prompt, max_new_tokens=20, stop_on_eos=False)
        sp = generate(fast, prompt, drafter=NGramDrafter(k=4), max_new_tokens=20, stop_on_eos=False)
        assert sp.tokens == ar.tokens


def test_auto_backend_choice():
    from cascade.models.backends.backend import BACKENDS, auto_backend, cpu_has_native_bf16
    from cascade.models.backends.cpu_kernels import fbgemm_available
    from cascade.models.backends.native import native_kernels

    chosen = auto_backend(torch.device("cpu"))
    if native_kernels() is not None:
        assert chosen == BACKENDS["native"]
    elif fbgemm_available():  # (tests/test_native.py runs this branch with the extension disabled)
        assert chosen == BACKENDS["fp16w"]
    else:
        assert chosen == (BACKENDS["bfloat16"] if cpu_has_native_bf16() else BACKENDS["onednn"])
    assert auto_backend(torch.device("cuda")) == BACKENDS["bfloat16"]


def test_backend_is_one_value_chosen_once_and_recorded_on_the_model():
    from cascade.models.backends.backend import BACKENDS, backend_named

    lm = load_model("tiny:0", "float64")
    assert lm.backend == BACKENDS["float64"] and lm.dtype == torch.float64
    assert load_model("tiny:0", torch.float32).backend.name == "float32"
    assert backend_named("bf16", torch.device("cpu")) == BACKENDS["bfloat16"]
    with pytest.raises(ValueError, match="unknown backend 'int3'"):
        load_model("tiny:0", "int3")
    with pytest.raises(ValueError, match="backend 'native' runs on cpu only"):
        backend_named("native", torch.device("cuda"))
    with pytest.warns(DeprecationWarning, match="pass backend="):
        legacy = load_model("tiny:0", dtype="float64")
    assert legacy.backend == BACKENDS["float64"]


def test_auto_quantization_choice():
    from cascade.models.backends.native import native_kernels
    from cascade.models.backends.quantize import resolve_method

    ext = native_kernels()  # (tests/test_native.py runs the no-extension branch with it disabled)
    expected = "int8_dynamic" if ext is None else ("int4_vnni" if ext.int8_dot_isa() != "none" else "int8_native")
    assert resolve_method("auto", torch.device("cpu")) == expected
    assert resolve_method("auto", torch.device("cuda")) == "nf4"
    assert resolve_method("int8_native", torch.device("cpu")) == "int8_native"
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_method("int3", torch.device("cpu"))


def test_top2_gap(tiny_target):
    logits = tiny_target.forward([1, 2], tiny_target.new_cache())[-1]
    top = torch.topk(logits, 2).values
    assert tiny_target.top2_gap([1, 2]) == pytest.approx(float(top[0] - top[1]))


def test_sliding_window_caches_are_refused():
    """Crop/compaction would leave a sliding-window layer's bookkeeping stale: refused up front."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cascade import generate
    from cascade.models import CausalLM

    cfg = Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    lm = CausalLM(Qwen2ForCausalLM(cfg).eval(), None, "sliding")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        generate(lm, [1, 2, 3], max_new_tokens=2)


def test_compaction_of_a_chain_prefix_is_a_crop(tiny_target):
    lm = tiny_target
    a, b = lm.new_cache(), lm.new_cache()
    for cache in (a, b):
        lm.forward([1, 2, 3, 4, 5, 6, 7], cache)
    lm.compact(a, 3, [0, 1])  # inputs 0, 1 of the 4 after the 3 committed positions
    lm.crop(b, 5)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


# ---- FBGEMM fp16-weight linears ----------------------------------------------------------------

def _bf16_valued(lm):
    """Round every weight to bf16 values (what a bf16 checkpoint holds), keeping fp32 storage."""
    with torch.no_grad():
        for p in lm.model.parameters():
            p.copy_(p.bfloat16().float())
    return lm


def test_fp16_weight_linear_equals_the_fp64_product():
    from cascade.models.backends.cpu_kernels import FP16WeightLinear, fbgemm_available

    if not fbgemm_available():
        pytest.skip("FBGEMM is not available in this torch build")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_((torch.randn(40, 96, generator=gen) * 0.05).bfloat16().float())
        linear.bias.copy_(torch.randn(40, generator=gen))
    fast = FP16WeightLinear(linear)
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, 96, generator=gen)
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        # fp32 accumulation over 96 terms: relative error ~1e-6 of the terms' magnitude
        torch.testing.assert_close(fast(x).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.dense_state()["weight"], linear.weight)


def test_fp16_exactness_check_refuses_what_fp16_cannot_hold():
    from cascade.models.backends.cpu_kernels import FP16WeightLinear, InexactWeightError, fp16_inexact, fbgemm_available, use_fp16_weight_linears

    w = torch.tensor([[1.0, 0.5, 2.0**-10, 70000.0], [2.0**-30, 1.0 + 2.0**-7, -3.0, 0.0]])
    assert fp16_inexact(w) == 2  # 70000 is out of range; 2^-30 is below fp16's subnormals
    if not fbgemm_available():
        pytest.skip("FBGEMM is not available in this torch build")
    linear = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    with pytest.raises(InexactWeightError, match="2 weight values"):
        FP16WeightLinear(linear)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), linear)
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight.bfloat16().float())
    swapped, kept = use_fp16_weight_linears(model)
    assert swapped == 1 and kept == ["1"] and type(model[1]) is torch.nn.Linear  # the inexact layer stays exact


def test_fp16_weight_backend_keeps_greedy_equality():
    from cascade import generate
    from cascade.drafters import NGramDrafter, SmallLMDrafter
    from cascade.models.backends.cpu_kernels import FP16WeightLinear, fbgemm_available, use_fp16_weight_linears

    if not fbgemm_available():
        pytest.skip("FBGEMM is not available in this torch build")
    dense = _bf16_valued(tiny_llama(vocab_size=64, seed=4, dtype="float32"))
    fast = _bf16_valued(tiny_llama(vocab_size=64, seed=4, dtype="float32"))
    swapped, kept = use_fp16_weight_linears(fast.model)
    assert swapped > 0 and not kept and isinstance(fast.model.lm_head, FP16WeightLinear) and fast.vocab_size == 64
    ids = [5, 9, 2, 7, 7, 1]
    torch.testing.assert_close(fast.forward(ids, fast.new_cache()), dense.forward(ids, dense.new_cache()), atol=1e-4, rtol=1e-4)
    drafter_lm = _bf16_valued(tiny_llama(vocab_size=64, seed=5, dtype="float32"))
    use_fp16_weight_linears(drafter_lm.model)  # the drafters' multi-token forwards use it too
    for prompt in ([1, 2, 3], [4, 4, 4, 4], [9, 8, 7, 9, 8]):
        ar = generate(fast, prompt, max_new_tokens=20, stop_on_eos=False)
        for drafter in (NGramDrafter(k=4), SmallLMDrafter(drafter_lm, k=4)):
            assert generate(fast, prompt, drafter=drafter, max_new_tokens=20, stop_on_eos=False).tokens == ar.tokens


def test_fp16w_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="onednn=True needs dtype float32"), pytest.warns(DeprecationWarning):
        load_model("tiny:0", dtype="fp16w", onednn=True)


def test_the_dispatch_backend_is_retired():
    """Per-(shape, rows) dispatch between FBGEMM and oneDNN was used by no config and measured no
    better than fp16w (docs/backends.md): it is not a backend any more, and naming it says so."""
    with pytest.raises(ValueError, match="unknown backend 'dispatch'"):
        load_model("tiny:0", "dispatch")


def test_shared_models_load_one_copy_per_set_of_arguments():
    """Inside shared_models() (each cascade.run), the same arguments give the same model object
    and others a model of their own; outside it every call loads afresh."""
    from cascade.models.loading import load_model, shared_models

    with shared_models():
        a = load_model("tiny:0", backend="float64")
        assert load_model("tiny:0", backend="float64") is a
        assert load_model("tiny:0", backend="float32") is not a
        assert load_model("tiny:1", backend="float64") is not a
        with shared_models():  # nested: the same table
            assert load_model("tiny:0", backend="float64") is a
    assert load_model("tiny:0", backend="float64") is not a


def _direct_vs_transformers(lm):
    """Outputs of the same calls through lm.forward and lm.transformers_forward: a prefill with
    two layers' hidden states, a chain step with keep_last, a tree step (siblings, own positions)
    with the final-norm states, a compaction to one tree path, and a step after it."""
    from cascade.tree_structure import tree_mask, tree_positions

    def calls(forward):
        cache = lm.new_cache()
        outs = list(forward(list(range(3, 20)), cache, return_hidden=(1, -1)))
        outs.append(forward([5, 9, 11], cache, keep_last=2))
        past = lm.cache_len(cache)
        parents = [-1, 0, 0, 1]  # [root] + 4 nodes: two siblings below the first node
        outs.extend(forward([4, 8, 12, 16, 20], cache, position_ids=tree_positions(parents, past),
                            attention_mask=tree_mask(parents, past), return_hidden=-1))
        lm.compact(cache, past, [0, 1, 2, 4])  # root, first node, its first child, that child's
        outs.append(forward([7], cache))
        return outs

    return calls(lm.forward), calls(lm.transformers_forward)


def test_direct_decoder_is_attached_and_bitwise_transformers_forward():
    """A model off the native kernels runs transformers' forward with its modules called directly
    (DirectDecoder, checked on a probe at the first forward): bitwise the same logits and hidden
    states on chains, trees, compaction and keep_last; and layer-level access (early exits) is
    bitwise the full forward's states after that layer."""
    from cascade.models.backends.direct import DirectDecoder, LlamaLayer, ModuleLayer
    from cascade.models.layers import run_layers

    lm = tiny_llama(vocab_size=40, num_layers=3, seed=2)
    assert lm.lean is None and lm.auto_direct
    mine, theirs = _direct_vs_transformers(lm)
    assert isinstance(lm.lean, DirectDecoder) and not lm.auto_direct
    assert all(isinstance(step, LlamaLayer) for step in lm.lean.steps)  # written out, not the modules' forwards
    assert len(mine) == len(theirs) == 6
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape and torch.equal(a, b)
    lm.use_forward(DirectDecoder(lm.model, explicit=False))  # each layer's own forward (other architectures)
    assert all(isinstance(step, ModuleLayer) for step in lm.lean.steps)
    for a, b in zip(*_direct_vs_transformers(lm)):
        assert torch.equal(a, b)
    _, after_one = lm.transformers_forward(list(range(3, 12)), lm.new_cache(), return_hidden=1)
    assert torch.equal(run_layers(lm, list(range(3, 12)), lm.new_cache(), 1), after_one)


def test_direct_decoder_is_refused_where_the_model_forward_does_more(caplog):
    """A model whose own forward does something its layers do not (here: logits scaled after the
    head) keeps transformers' forward, with the reason logged; auto_direct=False keeps it too."""
    import logging

    from cascade.models.lm import CausalLM

    lm = tiny_llama(vocab_size=40, num_layers=2, seed=3)
    plain = lm.model.forward

    def scaled(*args, **kwargs):
        out = plain(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    lm.model.forward = scaled
    with caplog.at_level(logging.INFO, logger="cascade.models.backends.direct"):
        logits = lm.forward([1, 2, 3], lm.new_cache())
    assert lm.lean is None and "differ from transformers' forward" in caplog.text
    assert torch.equal(logits, lm.transformers_forward([1, 2, 3], lm.new_cache()))
    lm.model.forward = plain
    off = CausalLM(lm.model, None, "tiny", auto_direct=False)
    off.forward([1, 2], off.new_cache())
    assert off.lean is None
