"""The drafter zoo: layer-skip self-drafting (shared weights and KV cache, no prefill), Kangaroo's
exit adapter, quantized drafters, and the stop policies. Greedy equality on float64 tiny models,
statistical losslessness under sampling (see stat_utils), cache discipline and error paths."""

import random

import pytest
import torch

from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.drafters import ConfidenceStop, LayerSkipDrafter, NGramDrafter, QuantizedLMDrafter, SmallLMDrafter, ThompsonStop
from cascade.models import load_model, perturbed_copy, tiny_llama
from cascade.models.heads.adapter import ExitAdapter
from cascade.models.layers import head_logits, layer_lengths, run_layers
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, StaticTreePolicy
from cascade.types import SamplingConfig
from cascade.drafters.base import DraftStart
from stat_utils import LEVEL, lossless_pvalue


def damped_target(vocab_size=32, num_layers=4, seed=0, damp=0.1, from_layer=2):
    """A float64 tiny Llama whose layers >= from_layer barely change the residual stream, so an
    early exit agrees with the full model often (a random model's shallow exit rarely does)."""
    lm = tiny_llama(vocab_size=vocab_size, num_layers=num_layers, seed=seed)
    with torch.no_grad():
        for layer in lm.model.model.layers[from_layer:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    return lm


@pytest.fixture(scope="module")
def target():
    return damped_target()


@pytest.fixture(scope="module")
def adapter(target):
    return ExitAdapter.from_target(target, 2)


def _drafters(target, adapter):
    return {
        "layer_skip_1": lambda: LayerSkipDrafter(1, k=4),
        "layer_skip_2": lambda: LayerSkipDrafter(2, k=5),
        "layer_skip_3_confidence": lambda: LayerSkipDrafter(3, k=6, stop=ConfidenceStop(0.5)),
        "layer_skip_2_thompson": lambda: LayerSkipDrafter(2, k=6, stop=ThompsonStop(0.5)),
        "kangaroo": lambda: LayerSkipDrafter(2, k=4, adapter=adapter),
        # the adapter is fed the target's hidden states of the accepted tree path (tree order)
        "kangaroo_static_tree": lambda: TreeDrafter([LayerSkipDrafter(2, adapter=adapter)], StaticTreePolicy((2, 2, 1, 1))),
        "kangaroo_dytc_mixed": lambda: TreeDrafter([LayerSkipDrafter(2, adapter=adapter), NGramDrafter(k=2)],
                                                   DynamicTreePolicy(t_min=0.2, max_nodes=10, measure_costs=False)),
        "kangaroo_horizontal": lambda: HorizontalCascade([(LayerSkipDrafter(2, k=2, adapter=adapter), 2), (NGramDrafter(k=2), 2)]),
        "kangaroo_top_of_cascade": lambda: VerticalCascade([LayerSkipDrafter(3, k=5, adapter=ExitAdapter.from_target(target, 3)),
                                                            LayerSkipDrafter(1, k=2)]),
        "quantized_self": lambda: QuantizedLMDrafter(target, "int8_dynamic", k=4),
        "small_lm_thompson": lambda: SmallLMDrafter(tiny_llama(vocab_size=32, seed=3), k=4, stop=ThompsonStop(0.3)),
        "double_early_exit": lambda: VerticalCascade([LayerSkipDrafter(3, k=6), LayerSkipDrafter(1, k=2)]),
        "exit_over_quantized": lambda: VerticalCascade([LayerSkipDrafter(3, k=5), QuantizedLMDrafter(target, "int8_dynamic", k=2)]),
        # three levels: a small LM, a layer skip of *that* LM (sharing its cache), prompt lookup
        "lm_exit_of_lm_ngram": lambda: VerticalCascade(
            [SmallLMDrafter(perturbed_copy(target, 0.05, seed=1), k=6), LayerSkipDrafter(2, k=3), NGramDrafter(k=2)]
        ),
    }


@pytest.mark.parametrize("name", list(_drafters(None, None)))
def test_greedy_equals_autoregressive(name, target, adapter):
    drafter = _drafters(target, adapter)[name]()
    rng = random.Random(3)
    accepted = 0
    for _ in range(5):
        prompt = [rng.randrange(32) for _ in range(rng.randint(1, 10))]
        for max_new in (1, 5, 23):
            ar = generate(target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (name, prompt, max_new)
            accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0, f"{name} never had a token accepted: the test would not exercise acceptance"


def test_forward_returns_the_exit_hidden_states(target):
    """CausalLM.forward(return_hidden=L) gives what the first L layers compute (the states the
    Kangaroo adapter is fed), in chain and in tree order."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    logits, hidden = target.forward(ids, target.new_cache(), return_hidden=2)
    assert torch.allclose(hidden, run_layers(target, ids, target.new_cache(), 2), atol=1e-9, rtol=0)
    assert torch.allclose(logits, target.forward(ids, target.new_cache()), atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="return_hidden"):
        target.forward(ids, target.new_cache(), return_hidden=4)


def test_kangaroo_cannot_be_a_lower_cascade_level(target, adapter):
    with pytest.raises(ValueError, match="hidden states"):
        VerticalCascade([LayerSkipDrafter(3, k=4), LayerSkipDrafter(2, k=2, adapter=adapter)])


def test_layer_stack_with_all_layers_equals_the_model(target):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    full = target.forward(ids, target.new_cache())
    cache = target.new_cache()
    hidden = run_layers(target, ids, cache, 4)
    assert torch.allclose(head_logits(target, hidden), full, atol=1e-9, rtol=0)
    assert layer_lengths(cache) == [8] * 4


def test_layer_skip_does_no_prefill(target):
    """Tokens processed by the shallow layers beyond what the target processed = tokens drafted:
    the drafter never runs the prompt (or anything already committed) through its layers."""
    counts = [0] * 4
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, i=i: counts.__setitem__(i, counts[i] + args[0].shape[1]))
        for i, layer in enumerate(target.model.model.layers)
    ]
    try:
        prompt = list(range(1, 30))  # a long prompt: any drafter prefill would show
        with target.module_calls():  # the hooks see every layer call
            out = generate(target, prompt, drafter=LayerSkipDrafter(2, k=4), max_new_tokens=20, stop_on_eos=False)
    finally:
        for h in hooks:
            h.remove()
    target_tokens = (len(prompt) - 1) + sum(s.drafted + 1 for s in out.steps)
    assert counts[2] == counts[3] == target_tokens  # layers above the exit: target only
    drafted = sum(s.drafted for s in out.steps)
    assert counts[0] - target_tokens == counts[1] - target_tokens == drafted
    assert drafted > 0


def test_cache_is_left_as_found(target, adapter):
    for drafter in (LayerSkipDrafter(2, k=4), LayerSkipDrafter(2, k=4, adapter=adapter)):
        cache = target.new_cache()
        prompt = [5, 6, 7, 8, 9]
        drafter.check_compatible(target)
        _, hidden = target.forward(prompt[:-1], cache, return_hidden=2)  # the prefills, as generate() does them
        drafter.start(DraftStart(target, cache, prompt, SamplingConfig(), None, hidden))
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        block = drafter.propose(prompt, 4)
        drafter.score(prompt + block.tokens.tolist()[:2], [1, 2])
        assert layer_lengths(cache) == [4] * 4
        for (k, v), layer in zip(before, cache.layers):
            assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_layer_skip_logits_equal_a_fresh_shallow_run(target, adapter):
    """After a generation, the drafter's next-token logits (from the shared cache, and for the
    adapter from its own incrementally built cache) equal a from-scratch computation."""
    for drafter in (LayerSkipDrafter(2, k=4), LayerSkipDrafter(2, k=4, adapter=adapter)):
        prompt = [2, 7, 1, 8, 2, 8]
        out = generate(target, prompt, drafter=drafter, max_new_tokens=15, stop_on_eos=False)
        seq = prompt + out.tokens
        got = drafter.score(seq)[-1]
        hidden = run_layers(target, seq, target.new_cache(), 2)
        if drafter.adapter is None:
            want = head_logits(target, hidden)[-1]
        else:
            with torch.no_grad():
                want = target.model.lm_head(adapter(target, hidden, torch.arange(len(seq))))[-1]
        assert torch.allclose(got, want, atol=1e-9, rtol=0)


def test_adapter_checkpoint_roundtrip_and_refusals(target, adapter, tmp_path):
    with torch.no_grad():
        adapter.in_norm.weight.add_(0.01)  # make it differ from a fresh init
    path = adapter.save(tmp_path / "a.pt", metrics={"alpha_after": 0.5})
    loaded = ExitAdapter.load(path, target)
    for (n, a), (_, b) in zip(adapter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.float(), b.float()), n
    assert loaded.metrics == {"alpha_after": 0.5}
    drafter = LayerSkipDrafter(2, k=3, adapter=str(path))
    out = generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=6, stop_on_eos=False)
    assert out.tokens == generate(target, [1, 2, 3], max_new_tokens=6, stop_on_eos=False).tokens
    with pytest.raises(ValueError, match="exit layer 2"):
        generate(target, [1, 2, 3], drafter=LayerSkipDrafter(1, adapter=str(path)), max_new_tokens=3)
    with pytest.raises(FileNotFoundError, match="train one"):
        generate(target, [1, 2, 3], drafter=LayerSkipDrafter(2, adapter=str(tmp_path / "none.pt")), max_new_tokens=3)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):
        ExitAdapter.load(tmp_path / "bad.pt", target)


def test_bad_inputs(target):
    with pytest.raises(ValueError, match="below the target's 4 layers"):
        generate(target, [1, 2], drafter=LayerSkipDrafter(4), max_new_tokens=3)
    with pytest.raises(ValueError, match="positive integer"):
        LayerSkipDrafter(0)
    with pytest.raises(RuntimeError, match="not started"):
        d = LayerSkipDrafter(2)
        d.check_compatible(target)
        d.propose([1, 2, 3], 2)
    with pytest.raises(ValueError, match="backend 'nf4' runs on cuda only"):
        load_model("tiny:0", "nf4", device="cpu")
    with pytest.raises(ValueError, match="unknown backend 'int3'"):
        load_model("tiny:0", "int3")
    with pytest.raises(ValueError, match="either stop"):
        SmallLMDrafter(target, stop=ConfidenceStop(0.5), stop_below=0.5)
    with pytest.raises(ValueError, match="threshold"):
        ThompsonStop(1.5)
    with pytest.raises(ValueError, match="prior"):
        ThompsonStop(0.5, prior=(0.0, 1.0))


# ---- stop policies ------------------------------------------------------------------------------

def test_confidence_stop_decisions_are_logged_and_obeyed(target):
    out = generate(target, [1, 2, 3, 4], drafter=LayerSkipDrafter(2, k=6, stop=ConfidenceStop(1.0)), max_new_tokens=12, stop_on_eos=False)
    assert all(s.drafted <= 1 for s in out.steps)  # no token has probability >= 1
    logged = [s.stop for s in out.steps if s.stop]  # not asked when the budget is 1
    assert len(logged) >= len(out.steps) - 1 and all(d == [{"pos": 0, "top_p": d[0]["top_p"], "go": False}] for d in logged)
    out = generate(target, [1, 2, 3, 4], drafter=LayerSkipDrafter(2, k=6, stop=ConfidenceStop(0.0)), max_new_tokens=20, stop_on_eos=False)
    assert max(s.drafted for s in out.steps) == 6


def test_thompson_posterior_learns_from_verification(target):
    good = ThompsonStop(0.5)
    generate(target, [1, 2, 3, 4], drafter=LayerSkipDrafter(3, k=4, stop=good), max_new_tokens=40, stop_on_eos=False)
    bad = ThompsonStop(0.5)
    far = tiny_llama(vocab_size=32, seed=9)
    generate(target, [1, 2, 3, 4], drafter=SmallLMDrafter(far, k=4, stop=bad), max_new_tokens=40, stop_on_eos=False)
    assert good.accepted + good.rejected > 0 and bad.accepted + bad.rejected > 0
    assert good.state()["posterior_mean"] > bad.state()["posterior_mean"]
    # a drafter whose posterior has collapsed towards 0 almost always stops after one token
    out = generate(target, [1, 2, 3, 4], drafter=SmallLMDrafter(far, k=4, stop=ThompsonStop(0.9, prior=(1, 50))),
                   max_new_tokens=30, stop_on_eos=False)
    assert sum(s.drafted for s in out.steps) <= len(out.steps) + 2
    assert all("theta" in d for s in out.steps for d in s.stop)


def test_thompson_is_reproducible_from_the_seed(target):
    runs = [
        generate(target, [1, 2, 3], drafter=LayerSkipDrafter(2, k=5, stop=ThompsonStop(0.5)), max_new_tokens=20,
                 sampling=SamplingConfig(temperature=1.0), seed=4, stop_on_eos=False)
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert [s.stop for s in runs[0].steps] == [s.stop for s in runs[1].steps]


# ---- sampling losslessness ----------------------------------------------------------------------

V = 6
N = 600  # generations per lossless test (the broken doubles still fail by far)
PROMPT = [1, 4, 1]
SETTING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def small_target():
    return damped_target(vocab_size=V, num_layers=3, seed=11, damp=0.3, from_layer=1)


@pytest.mark.parametrize(
    "kind", ["layer_skip", "layer_skip_thompson", "kangaroo", "kangaroo_tree", "quantized", "double_early_exit_confidence",
             "lm_exit_of_lm"]
)
def test_sampling_is_lossless(kind, small_target):
    t = small_target
    drafter = {
        "layer_skip": lambda: LayerSkipDrafter(1, k=3),
        "layer_skip_thompson": lambda: LayerSkipDrafter(2, k=3, stop=ThompsonStop(0.4)),
        "kangaroo": lambda: LayerSkipDrafter(1, k=3, adapter=ExitAdapter.from_target(t, 1)),
        "kangaroo_tree": lambda: TreeDrafter([LayerSkipDrafter(1, adapter=ExitAdapter.from_target(t, 1))], StaticTreePolicy((2, 2))),
        "quantized": lambda: QuantizedLMDrafter(t, "int8_dynamic", k=3),
        "double_early_exit_confidence": lambda: VerticalCascade(
            [LayerSkipDrafter(2, k=3), LayerSkipDrafter(1, k=2, stop=ConfidenceStop(0.4))]
        ),
        "lm_exit_of_lm": lambda: VerticalCascade(
            [SmallLMDrafter(perturbed_copy(t, 0.2, seed=5), k=3), LayerSkipDrafter(1, k=2), NGramDrafter(k=1)]
        ),
    }[kind]()
    assert lossless_pvalue(t, drafter, SETTING, PROMPT, N) > LEVEL


class _WrongQ(LayerSkipDrafter):
    """Samples from the exit's distribution but reports a flatter one as q."""

    def propose(self, context, budget):
        block = super().propose(context, budget)
        if block.q is not None:
            block.q = torch.softmax(torch.log(block.q.clamp_min(1e-30)) * 0.2, -1)
        return block


def test_layer_skip_reporting_a_wrong_q_fails(small_target):
    """The test can fail: a drafter whose reported q is not the law its tokens were drawn from."""
    assert lossless_pvalue(small_target, _WrongQ(1, k=3), SETTING, PROMPT, N) < LEVEL


@pytest.mark.gpu
def test_nf4_quantized_drafter_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("bitsandbytes NF4 needs CUDA; this machine has no GPU")
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    target = load_model("smollm2-135m", backend="bfloat16", device="cuda")
    drafter = QuantizedLMDrafter("smollm2-135m", "nf4", device="cuda", k=4)
    ids = target.encode("def fibonacci(n):")
    ar = generate(target, ids, max_new_tokens=24)
    sp = generate(target, ids, drafter=drafter, max_new_tokens=24)
    assert sp.tokens == ar.tokens
    assert sp.summary().alpha > 0.3
