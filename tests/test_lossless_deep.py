"""Sampling losslessness with deep drafts, against an independent reference (see deep_stats).

Every method drafts up to 5 tokens deep (trees: depth 4) in generations of L = 6 tokens, with a
drafter close enough to the target that multi-token accepts and rejections at every depth are
frequent (each test asserts it and reports the depth distribution). The law of the 6 tokens is
compared pair by pair with the exact law computed from the Hugging Face model and transformers'
warpers. The default suite runs each method under one of temperature / top-k / top-p (rotating)
and the subtly broken doubles (tests/broken_doubles.py) it catches at its sample size; ``-m slow``
runs every method under every setting with more generations, and the doubles that need them.
tests/power_table.py measures the power over many seeds.
"""

import numpy as np
import pytest
import torch

from broken_doubles import (EXACT_DOUBLES, VERIFIERS, FullQPrunedDrafter, MiddleResidualCascade, NoReplacementStaticTree,
                             UntruncatedQDrafter)
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade import generate
from cascade.drafters import (ConfidenceStop, Datastore, DraftHeadDrafter, LayerSkipDrafter, NGramDrafter, QuantizedLMDrafter, SmallLMDrafter,
                              SuffixDrafter, ThompsonStop, TokenRecyclingDrafter)
from cascade.models import perturbed_copy, tiny_llama
from cascade.models.heads.adapter import ExitAdapter
from cascade.models.heads.pruned_head import prune_head
from cascade.sampling import logits_to_probs
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy
from cascade.types import SamplingConfig
from cascade.verify import VERIFIERS as RULES
from head_fit import eagle3_release, eagle_release, fitted_head
from deep_stats import LEVEL, exact_law, hf_warpers, lossless_pvalue, sample_outputs

V = 5
L = 6
PROMPT = [1, 4, 1, 4]
PROMPTS = [PROMPT, [3, 0, 2]]  # the default suite alternates them by method
N_FAST = 1000  # generations per test in the default suite
N_SLOW = 3000  # with -m slow
SETTINGS = {
    "temperature": dict(temperature=1.0),
    "cold": dict(temperature=0.6),  # T != 1 without truncation: warped and raw laws differ everywhere
    "top_k": dict(temperature=1.5, top_k=3),
    "top_p": dict(temperature=1.5, top_p=0.9),
}


def damped(seed=11, layers=3, device="cpu"):
    """A float64 tiny Llama whose layers >= 1 change the residual stream less than the first:
    early exits agree with it often (layer skip, Kangaroo), and its law is spread out (no pair of
    tokens above ~0.3), so a wrong law is visible."""
    lm = tiny_llama(vocab_size=V, num_layers=layers, seed=seed, init_range=0.25, device=device)
    with torch.no_grad():
        for layer in lm.model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.6)
            layer.mlp.down_proj.weight.mul_(0.6)
    return lm


@pytest.fixture(scope="module")
def models():
    target = damped()
    # close: accepted ~70% per position, so drafts of 4-5 are verified and rejected at every depth
    return target, perturbed_copy(target, 0.35, seed=3), perturbed_copy(target, 0.6, seed=4)


def target_store(target, n=40):
    """A datastore of the target's own sampled continuations of PROMPT (suffix lookups match often)."""
    return Datastore.build(PROMPT + generate(target, PROMPT, max_new_tokens=8, sampling=SamplingConfig(temperature=1.0), seed=i, stop_on_eos=False).tokens
                           for i in range(n))


def methods(target, close, far):
    return {
        "chain_small_lm": lambda: SmallLMDrafter(close, k=5),
        "chain_ngram": lambda: NGramDrafter(k=5, max_ngram=2),
        "chain_layer_skip": lambda: LayerSkipDrafter(2, k=5),
        "chain_kangaroo": lambda: LayerSkipDrafter(2, k=5, adapter=ExitAdapter.from_target(target, 2)),
        "chain_quantized": lambda: QuantizedLMDrafter(close, "int8_dynamic", k=5),
        # a drafter that cannot propose token 3 (LM head cut to 4 of 5 ids: q has structural zeros)
        "chain_pruned_head": lambda: SmallLMDrafter(prune_head(close, torch.tensor([0, 1, 2, 4])), k=5),
        "chain_confidence_stop": lambda: SmallLMDrafter(close, k=5, stop=ConfidenceStop(0.3)),
        "chain_thompson_stop": lambda: SmallLMDrafter(close, k=5, stop=ThompsonStop(0.3)),
        "vertical_2": lambda: VerticalCascade([SmallLMDrafter(close, k=5), SmallLMDrafter(far, k=2)]),
        "vertical_3": lambda: VerticalCascade([SmallLMDrafter(close, k=5), LayerSkipDrafter(2, k=2), NGramDrafter(k=1)]),
        "horizontal": lambda: HorizontalCascade([(SmallLMDrafter(close, k=3), 3), (SmallLMDrafter(far, k=2), 2)]),
        "static_tree": lambda: TreeDrafter([SmallLMDrafter(close)], StaticTreePolicy((2, 2, 1, 1))),
        # level-batched trees with the other LM drafter kinds (sampled children, depth 4)
        "static_tree_quantized": lambda: TreeDrafter([QuantizedLMDrafter(close, "int8_dynamic")], StaticTreePolicy((2, 1, 1, 1))),
        "static_tree_kangaroo": lambda: TreeDrafter([LayerSkipDrafter(2, adapter=ExitAdapter.from_target(target, 2))],
                                                    StaticTreePolicy((2, 1, 1, 1))),
        # ranked (deterministic) children chosen by global score, also under sampling
        "reranked_tree": lambda: TreeDrafter([SmallLMDrafter(close)], RerankedTreePolicy(top_k=2, depth=4, max_nodes=12)),
        "dynamic_tree": lambda: TreeDrafter([SmallLMDrafter(close), NGramDrafter(k=1), LayerSkipDrafter(2, sample=False)],
                                            DynamicTreePolicy(t_min=0.02, max_nodes=24, max_depth=5, max_rank=1,
                                                              prior_drafter_cost=0.01, prior_verify_slope=0.005, measure_costs=False)),
        # an EAGLE-style draft head, fitted for a few steps to the target
        "chain_draft_head": lambda: DraftHeadDrafter(fitted_head(target, motif=3), k=5),
        "static_tree_draft_head": lambda: TreeDrafter([DraftHeadDrafter(fitted_head(target, motif=3))],
                                                      StaticTreePolicy((2, 1, 1, 1))),
        # a published-format EAGLE-1/2 head (a fitted head written as EAGLE's code writes one, loaded back)
        "chain_eagle_release": lambda: DraftHeadDrafter(str(eagle_release(target, motif=3)), k=5),
        "dytc_draft_head": lambda: TreeDrafter([DraftHeadDrafter(fitted_head(target, motif=3)), SmallLMDrafter(close),
                                                NGramDrafter(k=1)],
                                               DynamicTreePolicy(t_min=0.02, max_nodes=24, max_depth=5, max_rank=1,
                                                                 prior_drafter_cost=0.01, prior_verify_slope=0.005, measure_costs=False)),
        # forward-free drafters (tables and datastores carry over across generations)
        "chain_recycling": lambda: TokenRecyclingDrafter(r=2, k=5),
        "tree_recycling": lambda: TokenRecyclingDrafter(r=3, tree=(3, 2, 1, 1)),  # deterministic siblings
        "vertical_recycling": lambda: VerticalCascade([SmallLMDrafter(close, k=5), TokenRecyclingDrafter(r=2, k=2)]),
        "chain_suffix": lambda: SuffixDrafter(target_store(target), k=5, min_ngram=1),
        "dytc_forward_free": lambda: TreeDrafter([SmallLMDrafter(close), TokenRecyclingDrafter(r=2, k=1),
                                                  SuffixDrafter(target_store(target), k=1, min_ngram=1)],
                                                 DynamicTreePolicy(t_min=0.02, max_nodes=24, max_depth=5, max_rank=1,
                                                                   prior_drafter_cost=0.01, prior_verify_slope=0.005, measure_costs=False)),
        # a published-format EAGLE-3 head (three captured layers, a draft vocabulary lacking id 3:
        # that id comes only from the residual), fitted and written as EAGLE-3's code writes one
        "chain_eagle3_release": lambda: DraftHeadDrafter(str(eagle3_release(target, layers=(1, 2, 2), drop=(3,))), k=5),
    }


METHODS = list(methods(None, None, None))
# covered in the default suite by the other forward-free methods (tree, cascade level, suffix,
# dynamic tree); every setting under -m slow
SLOW_ONLY = {"chain_recycling"}
# which depths a method must exercise (accepts and rejections, >= 20 each)
# (the reranked tree keeps its highest-scored nodes: under T = 0.6 and top-k its depth-4 nodes
# rarely make the cut, 13 accepts there in 1,000 generations; depth 3 is asserted)
DEPTH = {"chain_ngram": 1, "chain_confidence_stop": 2, "chain_layer_skip": 3, "chain_kangaroo": 2, "reranked_tree": 3}
# cells of the -m deep run whose depth-4 events numbered 14-18 of one kind in 1,000 generations
# (the Thompson stop stops earlier under these settings; the forward-free chains' tables are
# shallower on this prompt): they run 2,500 generations, so depth 4 reaches >= 20 of each
# (expected 35-45) and is asserted like every other cell's
N_BY_CELL = {("chain_thompson_stop", "temperature"): 2500, ("chain_thompson_stop", "cold"): 2500,
             ("chain_thompson_stop", "top_k"): 2500, ("chain_recycling", "top_p"): 2500, ("chain_suffix", "temperature"): 2500}
_laws: dict = {}


# methods whose trees give some node >= 2 children at depth 1: sibling events asserted there
SIBLINGS = {"static_tree", "static_tree_quantized", "static_tree_kangaroo", "reranked_tree", "dynamic_tree",
            "static_tree_draft_head", "dytc_draft_head", "tree_recycling", "dytc_forward_free"}


def law(target, setting, prompt=0):
    if (setting, prompt) not in _laws:
        _laws[(setting, prompt)] = exact_law(target.model, PROMPTS[prompt], L, **SETTINGS[setting])
    return _laws[(setting, prompt)]


def _check(models, method, setting, n, seed=0, verifier=None, drafter=None, prompt=0):
    target, close, far = models
    make = drafter or methods(target, close, far)[method]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        samples = sample_outputs(target, make, PROMPTS[prompt], L, n, seed, SETTINGS[setting], verifier=verifier)
    finally:
        torch.set_num_threads(threads)
    return samples, lossless_pvalue(samples, law(target, setting, prompt))


def _assert_lossless(method, label, samples, p, setting=None):
    """The exact code passes: accepts and rejections at every depth the method reaches, bonus
    tokens, and (trees) siblings judged after a rejected sibling, >= 20 of each; and p > LEVEL.
    ``label`` names the cell in the failure message."""
    report = f"{label}: p={p:.2g}; {samples.depth_report()}"
    depth = DEPTH.get(method, 4)
    assert samples.exercised(depth, 20), "the test does not exercise deep drafts: " + report
    assert samples.event_count("bonus") >= 20, "too few bonus tokens: " + report
    if method in SIBLINGS:
        assert samples.event_count("sibling", 1) >= 20, "too few sibling judgements: " + report
    assert p > LEVEL, report


def test_sampling_matches_transformers_warpers():
    """cascade.sampling equals softmax(transformers' warpers in generate's order) on random logits."""
    gen = torch.Generator().manual_seed(0)
    for cfg in (dict(temperature=0.7), dict(temperature=1.5, top_k=3), dict(temperature=1.2, top_p=0.8),
                dict(temperature=0.9, top_k=20, top_p=0.7), dict(temperature=1.0, top_p=0.5)):
        logits = torch.randn(8, 50, generator=gen, dtype=torch.float64) * 3
        want = torch.softmax(hf_warpers(cfg["temperature"], cfg.get("top_k"), cfg.get("top_p"))(None, logits.clone()), -1)
        got = logits_to_probs(logits, SamplingConfig(**cfg))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_reference_warpers_are_generates_own():
    """The reference's warpers (deep_stats.hf_warpers) equal what transformers' generate builds
    for the same settings (its own logits-processor builder), in the same order, on random logits."""
    from transformers import GenerationConfig

    lm = tiny_llama(vocab_size=50, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    for temperature, top_k, top_p in [(0.6, None, None), (1.5, 3, None), (1.5, None, 0.9), (0.9, 20, 0.7), (1.0, None, 0.5)]:
        config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k or 0,
                                  top_p=1.0 if top_p is None else top_p)
        theirs = lm.model._get_logits_processor(generation_config=config, input_ids_seq_length=1, device="cpu")
        ours = hf_warpers(temperature, top_k, top_p)
        assert [type(w) for w in ours] == [type(w) for w in theirs]
        logits = torch.randn(4, 50, generator=gen, dtype=torch.float64) * 3
        torch.testing.assert_close(ours(None, logits.clone()), theirs(None, logits.clone()), atol=0, rtol=0)


def test_reference_is_a_distribution_and_not_degenerate(models):
    for setting in SETTINGS:
        for prompt in range(len(PROMPTS)):
            p = law(models[0], setting, prompt)
            assert abs(p.sum() - 1) < 1e-9
            # many likely pairs at every position: the tests can see a wrong law (T = 0.6 sharpens
            # the law by design: >= 4 there)
            for a in range(L - 1):
                pair = p.sum(axis=tuple(i for i in range(L) if i not in (a, a + 1)))
                assert (pair > 0.02).sum() >= (4 if setting == "cold" else 5), (setting, prompt, a)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in SLOW_ONLY])
def test_deep_drafts_are_lossless(method, models):
    setting, prompt = _default_cell(METHODS.index(method))
    samples, p = _check(models, method, setting, N_FAST, prompt=prompt)
    _assert_lossless(method, f"{method}/{setting}/prompt {prompt}", samples, p, setting)


def _broken(models, broken, n, seed=0):
    target, close, far = models
    if broken == "residual_eps":  # a rejection-path bug: judged with the far drafter (rejections at depth 1: ~50%)
        return _check(models, "chain_small_lm", "temperature", n, seed=seed, verifier=VERIFIERS[broken],
                      drafter=lambda: SmallLMDrafter(far, k=5))
    if broken == "middle_residual":
        return _check(models, "vertical_2", "temperature", n, seed=seed,
                      drafter=lambda: MiddleResidualCascade([SmallLMDrafter(close, k=5), SmallLMDrafter(far, k=2)]))
    if broken == "full_q_pruned":  # FR-Spec head: sampled from the pruned q, judged with the full one
        return _check(models, "chain_pruned_head", "temperature", n, seed=seed,
                      drafter=lambda: FullQPrunedDrafter(prune_head(close, torch.tensor([0, 1, 2, 4])), close, k=5))
    if broken == "sibling_vs_p":  # deterministic siblings: Token Recycling's tree
        return _check(models, "tree_recycling", "temperature", n, seed=seed, verifier=VERIFIERS[broken])
    if broken in WARPED_AND_TREE_DOUBLES:
        method, setting = WARPED_AND_TREE_DOUBLES[broken]
        drafter = None
        if broken == "untruncated_q":
            drafter = lambda: UntruncatedQDrafter(close, k=5)  # noqa: E731
        elif broken == "no_replacement":
            drafter = lambda: TreeDrafter([SmallLMDrafter(close)], NoReplacementStaticTree((2, 2, 1, 1)))  # noqa: E731
        elif broken == "stale_sibling":  # the far drafter and 3 siblings: more rejected siblings to go stale after
            drafter = lambda: TreeDrafter([SmallLMDrafter(far)], StaticTreePolicy((3, 3, 1, 1)))  # noqa: E731
        return _check(models, method, setting, n, seed=seed, verifier=VERIFIERS.get(broken), drafter=drafter)
    method = "static_tree" if broken == "mask_off_by_one" else "chain_small_lm"
    return _check(models, method, "temperature", n, seed=seed, verifier=VERIFIERS[broken])


# Doubles visible only under warping, and tree-sibling / commit doubles: (method, setting) each runs through
WARPED_AND_TREE_DOUBLES = {
    "warp_order": ("chain_small_lm", "top_p"),  # temperature after top-p in p
    "unwarped_draw": ("chain_small_lm", "cold"),  # recovered / bonus tokens from the unwarped p
    "untruncated_q": ("chain_small_lm", "top_k"),  # the drafter reports q before top-k
    "stale_sibling": ("static_tree", "temperature"),  # the far drafter's (3, 3, 1, 1) tree (_broken)
    "shared_uniform": ("static_tree", "temperature"),
    "no_replacement": ("static_tree", "temperature"),
    "bonus_from_q": ("chain_small_lm", "temperature"),
    "commit_off_by_one": ("static_tree", "temperature"),
}


# not caught by the chi-square at N_FAST on these tiny models (power table in docs/testing.md):
# one uniform shared by siblings moves the law too little here (the exact per-draft test
# tests/test_verify_rules.py::test_recursive_rejection_draws_follow_its_exact_law catches it);
# the commit off-by-one only moves the keys of later steps, which these models barely weigh:
# greedy equality on float64 models catches it exactly (tests/test_tree.py)
WEAK_AT_N_FAST = {"shared_uniform", "commit_off_by_one"}


# caught reliably only with more generations (power table): run at N_SLOW by the slow test CI runs
SUBTLER = ["residual_eps", "bonus_wrong_row", "stale_sibling"]


@pytest.mark.parametrize("broken", ["q_wrong_position", "middle_residual", "sibling_vs_p", "full_q_pruned",
                                    *(d for d in WARPED_AND_TREE_DOUBLES if d not in WEAK_AT_N_FAST and d not in SUBTLER)])
def test_broken_doubles_fail(broken, models):
    samples, p = _broken(models, broken, N_FAST)
    assert p < LEVEL, f"{broken} passed: p={p:.2g}; {samples.depth_report()}"


@pytest.mark.slow
@pytest.mark.parametrize("broken", SUBTLER)
def test_subtler_broken_doubles_fail_with_more_samples(broken, models):
    """Caught at N_SLOW (one run each at another seed: p 6e-7 and 1e-44; this test's seed passes
    too), not reliably at N_FAST (power table: 3/10 and 10/10 over seeds; this suite's seed: p 0.03
    and 0.001). The stale sibling residual (25% of rejections): 3/10 at N_FAST on the close
    drafter's (2, 2, 1, 1) tree, 3/10 on the far drafter's (3, 3, 1, 1) (median p 0.003); at
    N_SLOW see docs/testing.md.
    mask_off_by_one is not caught at N_FAST (p 0.6) on these tiny models: see the README."""
    samples, p = _broken(models, broken, N_SLOW)
    assert p < LEVEL, f"{broken} passed: p={p:.2g}; {samples.depth_report()}"


def _default_cell(i: int) -> tuple[str, int]:
    """The (setting, prompt) the default suite runs the i-th method (or rule cell) under."""
    return list(SETTINGS)[i % len(SETTINGS)], (i // len(SETTINGS)) % len(PROMPTS)


# Every (method, setting) cell the default suite does not run, at the default suite's size: CI runs
# them with `-m deep` (two pytest-xdist workers), so every cell is run on every change.
OTHER_CELLS = [(m, s) for i, m in enumerate(METHODS) for s in SETTINGS
               if m in SLOW_ONLY or s != _default_cell(i)[0]]


@pytest.mark.deep
@pytest.mark.parametrize("method,setting", OTHER_CELLS)
def test_deep_drafts_are_lossless_other_settings(method, setting, models):
    prompt = (list(SETTINGS).index(setting) + 1) % len(PROMPTS)
    samples, p = _check(models, method, setting, N_BY_CELL.get((method, setting), N_FAST), seed=2, prompt=prompt)
    _assert_lossless(method, f"{method}/{setting}/prompt {prompt}", samples, p, setting)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", METHODS)
def test_deep_drafts_are_lossless_every_setting(method, setting, models):
    prompt = list(SETTINGS).index(setting) % len(PROMPTS)
    samples, p = _check(models, method, setting, N_SLOW, seed=1, prompt=prompt)
    _assert_lossless(method, f"{method}/{setting}/prompt {prompt}", samples, p, setting)


def test_depth_report_counts_accepts_and_rejections():
    from deep_stats import Samples

    s = Samples(np.zeros((1, L)), {(0, True): 3, (2, True): 1, (3, False): 2})
    assert s.depth_report() == ("depth: accepted/rejected 1: 3/3, 2: 3/0, 3: 2/1; sibling events by depth none; "
                                "bonus events by depth none")


def test_sibling_and_bonus_events_are_counted_per_depth():
    from collections import Counter

    from deep_stats import _count_events

    events = Counter()
    # root -> 0, 1; 0 -> 2, 3; 1 -> 4. Path 1, 4: the root's first child rejected, the leaf 4 reached
    _count_events([-1, -1, 0, 0, 1], [1, 4], events)
    assert events == Counter({("sibling", 1): 1, ("bonus", 2): 1})
    # path 0, 3: a second child judged at depth 2 as well; node 3 is a leaf
    _count_events([-1, -1, 0, 0, 1], [0, 3], events)
    assert events == Counter({("sibling", 1): 1, ("sibling", 2): 1, ("bonus", 2): 2})
    # path 0, all of its children rejected: two judged at depth 2, no bonus
    _count_events([-1, -1, 0, 0, 1], [0], events)
    assert events[("sibling", 2)] == 2 and events[("bonus", 1)] == 0


# Block and traversal verification (cascade.verify) through the real loop: the chain, a vertical
# cascade (inner rounds judged by the same rule), and every tree policy for traversal.
RULE_METHODS = {
    "block": ["chain_small_lm", "vertical_2"],
    "traversal": ["chain_small_lm", "vertical_2", "static_tree", "reranked_tree", "dynamic_tree"],
}
RULE_CELLS = [(rule, m) for rule, ms in RULE_METHODS.items() for m in ms]


def _rule_check(models, rule, method, setting, n, seed=0, verifier=None, prompt=0):
    target, close, far = models
    make = None
    if method == "vertical_2":
        make = lambda: VerticalCascade([SmallLMDrafter(close, k=5), SmallLMDrafter(far, k=2)], verifier=rule)  # noqa: E731
    return _check(models, method, setting, n, seed=seed, verifier=verifier or RULES[rule], drafter=make, prompt=prompt)


@pytest.mark.parametrize("rule,method", RULE_CELLS)
def test_block_and_traversal_are_lossless(rule, method, models):
    setting, prompt = _default_cell(RULE_CELLS.index((rule, method)))
    samples, p = _rule_check(models, rule, method, setting, N_FAST, prompt=prompt)
    _assert_lossless(method, f"{rule}/{method}/{setting}", samples, p, setting)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("rule,method", RULE_CELLS)
def test_block_and_traversal_are_lossless_every_setting(rule, method, setting, models):
    samples, p = _rule_check(models, rule, method, setting, N_SLOW, seed=1)
    _assert_lossless(method, f"{rule}/{method}/{setting}", samples, p, setting)


@pytest.mark.parametrize("broken,rule,method", [("block_weight_shift", "block", "chain_small_lm"),
                                                ("traversal_stale", "traversal", "static_tree")])
def test_broken_block_and_traversal_fail(broken, rule, method, models):
    samples, p = _rule_check(models, rule, method, "temperature", N_FAST, verifier=VERIFIERS[broken])
    assert p < LEVEL, f"{broken} passed: p={p:.2g}; {samples.depth_report()}"


def test_rule_doubles_with_switches_off_are_the_real_rules():
    """The broken doubles above differ from the real rules only by their switch: with it off they
    draw the same results from the same generator."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(100):
        parents = [-1, 0, 1, 2] if trial % 2 else [-1, -1, 0, 1, 1, 3]
        n = len(parents)
        p = torch.softmax(torch.randn(n + 1, 6, generator=gen, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(n, 6, generator=gen, dtype=torch.float64) * 2, -1)
        tokens = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        for rule, double in EXACT_DOUBLES.items():
            if rule == "block" and trial % 2 == 0:
                continue
            a = RULES[rule].sampled(tokens, parents, q, p, torch.Generator().manual_seed(trial))
            b = double.sampled(tokens, parents, q, p, torch.Generator().manual_seed(trial))
            assert (a.path, a.next_token, a.judgements) == (b.path, b.next_token, b.judgements)


@pytest.mark.deep
@pytest.mark.parametrize("rule,method,setting", [(r, m, s) for i, (r, m) in enumerate(RULE_CELLS) for s in SETTINGS
                                                 if s != _default_cell(i)[0]])
def test_block_and_traversal_are_lossless_other_settings(rule, method, setting, models):
    prompt = (list(SETTINGS).index(setting) + 1) % len(PROMPTS)
    samples, p = _rule_check(models, rule, method, setting, N_FAST, seed=2, prompt=prompt)
    _assert_lossless(method, f"{rule}/{method}/{setting}/prompt {prompt}", samples, p, setting)
