"""Token trees: tree-attention forward equals sequential paths (float64, 1e-9), cache compaction,
greedy equality and statistical losslessness for static and dynamic trees (sampled,
deterministic and mixed-drafter children), a wrong residual update that the test catches, the
estimators, and the CUDA path (marked gpu)."""

import random

import pytest
import torch

from cascade import generate
from cascade.drafters import LayerSkipDrafter, NGramDrafter, QuantizedLMDrafter, SmallLMDrafter
from cascade.costs import RobustCurve
from cascade.estimators import AcceptanceTable
from cascade.models import perturbed_copy, tiny_llama
from cascade.tree_structure import children_of, depths_of, path_to, tree_mask, tree_positions
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy
from cascade.types import ACCEPTED, REJECTED, UNJUDGED, SamplingConfig, VerifyResult
from cascade.verify import Verifier, accept_greedy, accept_sampled
from cascade.drafters.base import Outcome
from stat_utils import LEVEL, lossless_pvalue


def random_tree(rng: random.Random, n: int, vocab: int, root_siblings: int = 0) -> tuple[list[int], list[int]]:
    parents = [-1] * root_siblings
    for i in range(root_siblings, n):
        parents.append(rng.randrange(-1, i))
    return [rng.randrange(vocab) for _ in range(n)], parents


def test_buffers_by_hand():
    parents = [-1, -1, 0, 0, 2]  # root -> {0, 1}; 0 -> {2, 3}; 2 -> {4}
    assert depths_of(parents) == [1, 1, 2, 2, 3]
    assert children_of(parents) == [[0, 1], [2, 3], [], [4], [], []]
    assert path_to(4, parents) == [0, 2, 4] and path_to(-1, parents) == []
    assert tree_positions(parents, 10).tolist() == [10, 11, 11, 12, 12, 13]
    allowed = (tree_mask(parents, 2)[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 0, 1],
    ]
    with pytest.raises(ValueError, match="precede"):
        depths_of([-1, 3, 0])


@pytest.mark.parametrize("seed,root_siblings", [(0, 0), (1, 6), (2, 12), (3, 1)])
def test_tree_forward_equals_sequential_paths(tiny_target, seed, root_siblings):
    rng = random.Random(seed)
    prefix = [rng.randrange(32) for _ in range(7)]
    tokens, parents = random_tree(rng, 20, 32, root_siblings)
    cache = tiny_target.new_cache()
    tiny_target.forward(prefix[:-1], cache)
    past = len(prefix) - 1
    logits = tiny_target.forward([prefix[-1]] + tokens, cache, position_ids=tree_positions(parents, past),
                                 attention_mask=tree_mask(parents, past, tiny_target.dtype))  # [n + 1, V]
    want_root = tiny_target.forward(prefix, tiny_target.new_cache())[-1]
    assert torch.allclose(logits[0], want_root, atol=1e-9, rtol=0)
    for i in range(len(tokens)):
        seq = prefix + [tokens[j] for j in path_to(i, parents)]
        want = tiny_target.forward(seq, tiny_target.new_cache())[-1]
        assert torch.allclose(logits[i + 1], want, atol=1e-9, rtol=0), i


def test_compaction_equals_a_cache_of_the_accepted_path(tiny_target):
    rng = random.Random(4)
    prefix = [rng.randrange(32) for _ in range(6)]
    tokens, parents = random_tree(rng, 15, 32, 4)
    accepted = path_to(14, parents)
    cache = tiny_target.new_cache()
    tiny_target.forward(prefix[:-1], cache)
    past = len(prefix) - 1
    tiny_target.forward([prefix[-1]] + tokens, cache, position_ids=tree_positions(parents, past),
                        attention_mask=tree_mask(parents, past, tiny_target.dtype))
    tiny_target.compact(cache, past, [0] + [i + 1 for i in accepted])
    seq = prefix + [tokens[i] for i in accepted]
    fresh = tiny_target.new_cache()
    tiny_target.forward(seq, fresh)
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-9, rtol=0) and torch.allclose(a.values, b.values, atol=1e-9, rtol=0)
    # continuing: the same greedy tokens as from the fresh cache
    cont_a, cont_b = [], []
    for cache_, out in ((cache, cont_a), (fresh, cont_b)):
        last = 7
        for _ in range(6):
            last = int(tiny_target.forward([last], cache_)[-1].argmax())
            out.append(last)
    assert cont_a == cont_b


def test_greedy_tree_verification_unit():
    tokens, parents = [5, 6, 7, 8], [-1, -1, 1, 1]  # root -> {5, 6}; 6 -> {7, 8}
    argmax = torch.tensor([6, 0, 8, 0, 3])  # root wants 6, node 1 (token 6) wants 8, node 3 (token 8) wants 3
    r = accept_greedy(tokens, parents, argmax)
    assert (r.path, r.num_accepted, r.next_token, r.all_accepted) == ([1, 3], 2, 3, True)
    assert r.judgements == [REJECTED, ACCEPTED, REJECTED, ACCEPTED]
    r = accept_greedy(tokens, parents, torch.tensor([9, 0, 0, 0, 0]))
    assert (r.path, r.next_token, r.all_accepted, r.judgements) == ([], 9, False, [REJECTED, REJECTED, UNJUDGED, UNJUDGED])


def test_sampled_tree_verification_single_step_distribution():
    """Exact check of recursive rejection at one node with mixed children (one sampled from q1,
    one deterministic, one sampled from q2): the output law, estimated over many runs, matches p."""
    V = 5
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05], dtype=torch.float64)
    q1 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    q2 = torch.tensor([0.05, 0.05, 0.6, 0.2, 0.1], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    n = 15000
    one_hot = torch.nn.functional.one_hot(torch.tensor(3), V).to(p)
    for _ in range(n):
        x1 = int(torch.multinomial(q1, 1, generator=gen))
        x3 = int(torch.multinomial(q2, 1, generator=gen))
        r = accept_sampled([x1, 3, x3], [-1, -1, -1], torch.stack([q1, one_hot, q2]), torch.stack([p, p, p, p]), gen)
        token = r.next_token if r.num_accepted == 0 else [x1, 3, x3][r.path[0]]
        counts[token] += 1
    tv = 0.5 * (counts / n - p.float()).abs().sum()
    assert tv < 0.025  # the sampling error of 15k draws is about 0.008


# ---- whole-loop tests ---------------------------------------------------------------------------

def _trees(target, close):
    return {
        "static_chain": lambda: TreeDrafter([SmallLMDrafter(close)], StaticTreePolicy((1, 1, 1, 1))),
        "static_wide": lambda: TreeDrafter([SmallLMDrafter(close)], StaticTreePolicy((4, 2, 1))),
        # guard=False, realised_window=0: the policy's trees as grown (the guarantee would verify
        # chains of them), so that branching trees are judged here; dynamic_guarded: with it
        "dynamic_lm": lambda: TreeDrafter([SmallLMDrafter(close)], DynamicTreePolicy(
            t_min=0.3, max_nodes=10, measure_costs=False, guard=False, realised_window=0)),
        "dynamic_mixed": lambda: TreeDrafter(
            [SmallLMDrafter(close), NGramDrafter(k=3), LayerSkipDrafter(1)],
            DynamicTreePolicy(t_min=0.2, max_nodes=16, measure_costs=False, prior_drafter_cost=0.05, prior_verify_slope=0.01,
                              guard=False, realised_window=0),
        ),
        "dynamic_guarded": lambda: TreeDrafter(
            [SmallLMDrafter(close), NGramDrafter(k=3), LayerSkipDrafter(1)],
            DynamicTreePolicy(t_min=0.2, max_nodes=16, measure_costs=False, prior_drafter_cost=0.05, prior_verify_slope=0.01),
        ),
        # measured costs: on tiny models a drafter forward costs about a target forward, so the
        # policy mostly stops drafting; only equality is checked
        "dynamic_measured": lambda: TreeDrafter(
            [SmallLMDrafter(close), NGramDrafter(k=3), LayerSkipDrafter(1)], DynamicTreePolicy(t_min=0.2, max_nodes=16, calibrate=True)
        ),
        "reranked": lambda: TreeDrafter([SmallLMDrafter(close)], RerankedTreePolicy(top_k=3, depth=4, max_nodes=8)),
        # the other LM drafter kinds, level by level (Kangaroo: tests/test_drafter_zoo.py)
        "static_quantized": lambda: TreeDrafter([QuantizedLMDrafter(close, "int8_dynamic")], StaticTreePolicy((2, 2, 1, 1))),
        "static_layer_skip": lambda: TreeDrafter([LayerSkipDrafter(1)], StaticTreePolicy((2, 2, 1, 1))),
    }


@pytest.mark.parametrize("name", list(_trees(None, None)))
def test_tree_greedy_equals_autoregressive(name, tiny_target, tiny_close_drafter):
    drafter = _trees(tiny_target, tiny_close_drafter)[name]()
    rng = random.Random(8)
    accepted = 0
    for _ in range(5):
        motif = [rng.randrange(32) for _ in range(rng.randint(1, 3))]
        prompt = (motif * 4)[: rng.randint(1, 10)]
        for max_new in (1, 3, 21):
            ar = generate(tiny_target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (name, prompt, max_new)
            accepted += sum(s.accepted for s in sp.steps)
    if name == "dynamic_measured":
        return
    assert accepted > 0
    assert any(s.drafted > max(depths_of(s.parents), default=0) for s in sp.steps) or name in ("static_chain", "dynamic_guarded")
    # level by level: an LM drafter runs at most one forward per depth (the reranked tree grows
    # its levels, then may drop the deepest nodes)
    for s in sp.steps:
        if s.tree is not None:
            depth = drafter.policy.depth if name == "reranked" else max(depths_of(s.parents), default=0) + 1
            assert s.tree.drafter_forwards <= depth


def test_dynamic_policy_logs_estimates_and_learns(tiny_target, tiny_close_drafter, tiny_far_drafter):
    drafter = TreeDrafter([SmallLMDrafter(tiny_close_drafter), SmallLMDrafter(tiny_far_drafter, name="far")],
                          DynamicTreePolicy(t_min=0.3, max_nodes=12, measure_costs=False, calibrate=True))
    for seed in range(3):
        out = generate(tiny_target, [1, 2, 3, seed], drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    logged = [s.tree for s in out.steps if s.tree is not None]  # the last step has no budget to draft
    assert len(logged) >= len(out.steps) - 1
    est = logged[-1].estimates
    assert est.verify_curve_s and est.forward_curve_s
    assert est.alpha[drafter.names[0]]["depth1"].n >= 1  # keyed by drafter, then depth
    close = drafter.policy.acceptance.table.mean(drafter.names[0], "depth1")
    far = drafter.policy.acceptance.table.mean(drafter.names[1], "depth1")
    assert close > far
    # the policy spends its nodes on the better drafter
    per = [d for stats in logged for d in stats.node_drafters]
    assert per.count(drafter.names[0]) >= per.count(drafter.names[1])


def test_censoring_unjudged_nodes_are_not_failures():
    drafter = TreeDrafter([NGramDrafter(k=2)], DynamicTreePolicy())
    table = drafter.policy.acceptance.table
    assert isinstance(table, AcceptanceTable)
    from cascade.trees.growth import Node

    drafter._verified = [Node(1, -1, 1, 0, 1, None, 1.0), Node(2, 0, 2, 0, 1, None, 1.0), Node(3, 1, 3, 0, 1, None, 1.0)]
    drafter.observe(Outcome([0], VerifyResult(0, 9, False, [], [REJECTED, UNJUDGED, UNJUDGED])))
    assert table.get(drafter.names[0], "depth1").n == 1
    assert not table.seen(drafter.names[0], "depth2") and not table.seen(drafter.names[0], "depth3")


def test_depth_acceptance_borrows_from_the_depth_above():
    """A depth's α̂ shrinks toward the depth above, not toward the flat prior: one judged node at a
    new depth must not price it far below a well-measured depth above it (which kept DyTC from
    ever drafting past it), while many failures there still pull it down."""
    from cascade.trees.acceptance import NodeAcceptance

    acc = NodeAcceptance(["lm"])
    assert acc.first_child(0, 1) == 0.5 and acc.first_child(0, 4) == 0.5  # nothing seen: the prior
    for ok in [True] * 80 + [False] * 10:
        acc.table.update("lm", "depth1", ok)
    d1 = (80 + 1) / (90 + 2)
    assert abs(acc.first_child(0, 1) - d1) < 1e-12
    assert abs(acc.first_child(0, 3) - d1) < 1e-12  # unseen depths take the one above
    acc.table.update("lm", "depth2", True)
    d2 = (1 + 2 * d1) / (1 + 2)
    assert abs(acc.first_child(0, 2) - d2) < 1e-12 and acc.first_child(0, 2) > 0.85  # a flat prior gave 2/3
    for _ in range(30):
        acc.table.update("lm", "depth3", False)
    assert acc.first_child(0, 3) < 0.1 and acc.first_child(0, 5) == acc.first_child(0, 3)
    assert acc.table.counts("lm", "depth3") == (0.0, 30) and acc.table.counts("lm", "depth9") == (0.0, 0)
    flat = NodeAcceptance(["lm"], depth_prior="flat")  # the Beta prior at every depth, for comparison
    flat.table = acc.table
    assert abs(flat.first_child(0, 2) - 2 / 3) < 1e-12 and flat.first_child(0, 4) == flat.first_child(0, 3) == 1 / 32
    with pytest.raises(ValueError, match="depth_prior"):
        NodeAcceptance(["lm"], depth_prior="deepest")


def test_siblings_are_calibrated_apart_from_first_children():
    """At one drafter probability a ranked sibling is accepted far less often than a first child;
    a bucket shared by both priced siblings from first children's record and filled the trees
    with them (accepted 5-10% of the time on HumanEval)."""
    from cascade.trees.acceptance import NodeAcceptance
    from cascade.trees.growth import Node

    acc = NodeAcceptance(["lm"])
    assert acc.confident(0, 0.4, 1) == acc.confident(0, 0.4, 2) == 0.4  # nothing seen: the calibrated prior
    first = [Node(7, -1, 1, 0, 1, None, 1.0, conf=0.4) for _ in range(20)]
    sibling = [Node(8, -1, 1, 0, 2, None, 1.0, conf=0.4) for _ in range(20)]
    acc.observe(first + sibling, [ACCEPTED] * 20 + [REJECTED] * 20)
    assert acc.confident(0, 0.4, 1) > 0.9 and acc.confident(0, 0.4, 2) < 0.1
    assert acc.confident(0, 0.4, 3) == acc.confident(0, 0.4, 2)  # every rank below the first shares one record
    assert acc.confident(0, 0.9, 2) == 0.9  # another bucket: still its prior
    shared = NodeAcceptance(["lm"], siblings_apart=False)  # one record for both, for comparison
    shared.observe(first + sibling, [ACCEPTED] * 20 + [REJECTED] * 20)
    assert shared.confident(0, 0.4, 1) == shared.confident(0, 0.4, 2) and 0.4 < shared.confident(0, 0.4, 2) < 0.6


def test_cost_curve_is_piecewise_and_monotone():
    curve = RobustCurve()

    def t(n):
        return curve.predict(n).seconds

    assert curve.predict(3) is None
    curve.update(1, 0.10)
    assert t(1) == 0.10 and abs(t(2) - 0.20) < 1e-12  # one size: proportional
    for n, s in ((4, 0.12), (8, 0.20), (16, 0.36)):  # flat-ish, then steep (a bandwidth-bound forward)
        curve.update(n, s)
    assert abs(t(2) - (0.10 + 0.02 / 3)) < 1e-12
    assert abs(t(12) - 0.28) < 1e-12
    assert abs(t(20) - 0.44) < 1e-12  # beyond the largest: the last segment's slope
    assert t(0) == 0.10
    curve.update(6, 0.05)  # a noisy small reading never makes a larger forward cheaper
    assert t(6) >= t(4)
    curve.update(4, 0.20)  # per size: the median of its window's samples
    curve.update(4, 0.13)
    assert curve._stats(4)[0] == 0.13
    curve.update(4, float("nan"))  # a broken timing is not a sample
    assert len(curve.samples[4]) == 3


def test_cost_curve_median_ignores_a_busy_host_and_keeps_its_spread():
    """Fewer than half of a size's samples slowed by other work keep its estimate among the quiet ones; the
    window's spread is the estimate's standard error (what DyTC's guard weighs a tree against)."""
    quiet, busy = RobustCurve(), RobustCurve()
    for i in range(16):
        for n in (1, 8):
            base = 0.100 if n == 1 else 0.120
            quiet.update(n, base + 0.001 * (i % 3))
            busy.update(n, base * 1.6 if i % 3 == 0 else base + 0.001 * (i % 3))  # 6 of 16 samples 60% slow
    assert quiet.predict(8).seconds == 0.121
    assert busy.predict(8).seconds <= 0.122 + 1e-12  # within the quiet samples (their mean would be 0.148)
    spread = RobustCurve()
    for i in range(16):
        spread.update(8, 0.100 + 0.01 * (i % 5))  # a host whose speed wanders by 40%
    assert 0 < quiet.predict(8).sd < spread.predict(8).sd  # a noisier window: a wider error


def test_dytc_prices_the_first_nodes_as_measured():
    """Δverify of the first nodes comes from the measured flat part, not a line fitted through 32."""
    policy = DynamicTreePolicy()
    policy.setup(["d"], None)
    for n, t in ((1, 0.120), (2, 0.125), (4, 0.135), (8, 0.190), (16, 0.300), (32, 0.650)):
        policy.prices.costs.observe_verify(n, t)
    first = policy.prices.verify_per_node(0)  # a tree of 0 nodes gets its first: t(2) - t(1)
    assert abs(first - 0.005 / 0.120) < 1e-9
    assert abs(policy.prices.verify_per_node(10) - (0.3 - 0.19) / 8 / 0.12) < 1e-9
    assert policy.prices.verify_per_node(0) < policy.prices.verify_per_node(10)


def test_dytc_prices_a_node_at_the_size_trees_end_at():
    """Every node shares the verification, which costs the curve at the tree's final size: once
    trees of ~6 nodes are seen, the first node of the next tree is priced at the slope there,
    not at the curve's flat start (which let level 1 fill with siblings nearly free)."""
    from cascade.trees.growth import Tree

    def policy(**kw):
        p = DynamicTreePolicy(**kw)
        p.setup(["d"], None)
        for n, t in ((1, 0.100), (2, 0.101), (3, 0.102), (5, 0.142), (7, 0.182), (9, 0.222)):
            p.prices.costs.observe_verify(n, t)  # flat to 3 inputs, then 0.02 s per input
        return p

    by_size, by_position = policy(), policy(price_at_tree_size=False)
    empty = Tree([1, 2, 3])
    assert abs(by_size._node(empty) - 0.01) < 1e-9  # no tree seen yet: its position (1 -> 2 inputs)
    for p in (by_size, by_position):
        for _ in range(30):
            p.prices.record_tree(6)
    assert abs(by_size.prices.tree_nodes - 6) < 1e-9
    assert abs(by_size._node(empty) - 0.2) < 1e-9  # 7 -> 8 inputs: 0.02 s over a 0.1 s step
    assert abs(by_size._node(empty, ahead=7) - 0.2) < 1e-9  # past the mean size: its position (also 0.02 s here)
    assert abs(by_position._node(empty) - 0.01) < 1e-9


def test_cost_curve_spreads_a_step_and_pools_an_outlier():
    """A forward whose time steps up (2 -> 3 inputs: +0.06 s, then flat to 8) prices each node up
    to 8 at its share of the step (the lower convex hull), so a node-by-node rule can reach the
    cheap nodes behind the step; one slow reading does not raise the larger sizes to it."""
    curve = RobustCurve()
    for n, t in ((1, 0.12), (2, 0.13), (3, 0.19), (4, 0.19), (6, 0.19), (8, 0.19), (16, 0.35)):
        curve.update(n, t)
    slopes = [curve.predict(n + 1).seconds - curve.predict(n).seconds for n in range(1, 16)]
    assert all(abs(s - 0.01) < 1e-12 for s in slopes[:7])  # (0.19 - 0.12) / 7 each, not 0.06 at the step
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))  # marginal prices rise with n
    assert curve.predict(1).seconds == 0.12 and abs(curve.predict(8).seconds - 0.19) < 1e-12
    assert abs(curve.predict(16).seconds - 0.35) < 1e-12

    noisy = RobustCurve()
    for _ in range(3):
        for n, t in ((1, 0.12), (2, 0.125), (4, 0.135), (6, 0.15), (8, 0.17)):
            noisy.update(n, t)
    noisy.update(3, 0.30)  # once, disturbed
    assert noisy.predict(4).seconds < 0.2 and noisy.predict(8).seconds < 0.2  # (a running maximum put both at 0.30)
    assert all(b >= a for (_, a, _), (_, b, _) in zip(noisy.points(), noisy.points()[1:]))


def test_cost_curve_forgets_sizes_no_longer_measured():
    """A calibration point the policy never visits again (one input, timed at a faster moment of
    the host) leaves the curve once ``window`` live measurements have come: the live verifications
    (flat at 0.070 s over 2-9 inputs) then set both the step and the price of a node."""
    curve = RobustCurve()  # the window the policies use: 48 updates
    assert curve.window == 48
    for n, t in ((1, 0.045), (2, 0.047), (4, 0.049), (8, 0.065), (16, 0.113)):  # calibration
        curve.update(n, t)
    live = [(2 + i % 8, 0.070 + 0.0005 * (i % 8)) for i in range(80)]  # 10 per size
    for n, t in live[:20]:
        curve.update(n, t)
    assert curve.predict(1).seconds == 0.045 and 1 in curve.current()  # within the window: still used
    for n, t in live[20:]:
        curve.update(n, t)
    assert curve.current() == list(range(2, 10)) and curve.sizes == 8
    assert abs(curve.predict(1).seconds - curve.predict(2).seconds) < 1e-12 and curve.predict(1).seconds > 0.066  # flat below
    slope = (curve.predict(9).seconds - curve.predict(2).seconds) / 7
    assert 0 <= slope < 0.001  # each node ~0.0005 s, not the 0.003 s the stale point at 1 made it
    with pytest.raises(ValueError, match="window"):
        RobustCurve(window=0)


def test_bad_policies():
    with pytest.raises(ValueError):
        StaticTreePolicy((2, 0))
    with pytest.raises(ValueError):
        DynamicTreePolicy(max_nodes=0)
    with pytest.raises(TypeError, match="LM drafter"):
        TreeDrafter([NGramDrafter()], StaticTreePolicy((2,)))
    with pytest.raises(ValueError, match="at least one"):
        TreeDrafter([])


# ---- sampling losslessness ----------------------------------------------------------------------

V = 6
N = 600  # generations per lossless test (the broken doubles still fail by far)
PROMPT = [1, 4, 1]
SETTING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def small_models():
    return tiny_llama(vocab_size=V, seed=11, init_range=0.4), tiny_llama(vocab_size=V, seed=12, init_range=0.4)


def _sampled_trees(target, drafter_lm):
    return {
        "sampled_children": lambda: TreeDrafter([SmallLMDrafter(drafter_lm)], StaticTreePolicy((3, 2))),
        "deterministic_children": lambda: TreeDrafter([SmallLMDrafter(drafter_lm, sample=False)], StaticTreePolicy((3, 2))),
        "mixed_drafters": lambda: TreeDrafter(
            [SmallLMDrafter(drafter_lm), NGramDrafter(k=2), LayerSkipDrafter(1, sample=False)],
            DynamicTreePolicy(t_min=0.05, max_nodes=8, measure_costs=False),
        ),
    }


@pytest.mark.parametrize("name", list(_sampled_trees(None, None)))
def test_tree_sampling_is_lossless(name, small_models):
    target, drafter_lm = small_models
    assert lossless_pvalue(target, _sampled_trees(target, drafter_lm)[name](), SETTING, PROMPT, N) > LEVEL


def _no_residual_update(tokens, parents, q, p, generator):
    """Wrong: after a rejected child, the next child is tried against p itself, not the residual."""
    kids = children_of(parents)
    path, j = [], 0
    judgements = [UNJUDGED] * len(tokens)
    while True:
        nxt = None
        for c in kids[j]:
            qx = 1.0 if q is None else float(q[c][tokens[c]])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * qx < float(p[j][tokens[c]]):
                nxt = c
                break
        if nxt is None:
            return VerifyResult(len(path), int(torch.multinomial(p[j], 1, generator=generator)), not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


def test_wrong_residual_update_fails(small_models):
    target, drafter_lm = small_models
    drafter = TreeDrafter([SmallLMDrafter(drafter_lm)], StaticTreePolicy((3, 2)))
    assert lossless_pvalue(target, drafter, SETTING, PROMPT, N, verifier=Verifier(sampled=_no_residual_update)) < LEVEL


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tree_verifier_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    target = tiny_llama(vocab_size=32, seed=0, dtype="float32", device="cuda")
    close = perturbed_copy(target, 0.05, seed=1)
    rng = random.Random(0)
    prefix = [rng.randrange(32) for _ in range(7)]
    tokens, parents = random_tree(rng, 24, 32, 6)
    cache = target.new_cache()
    target.forward(prefix[:-1], cache)
    logits = target.forward([prefix[-1]] + tokens, cache, position_ids=tree_positions(parents, 6),
                            attention_mask=tree_mask(parents, 6, target.dtype).cuda())
    for i in range(len(tokens)):
        seq = prefix + [tokens[j] for j in path_to(i, parents)]
        assert torch.allclose(logits[i + 1], target.forward(seq, target.new_cache())[-1], atol=1e-4, rtol=1e-4)
    drafter = TreeDrafter([SmallLMDrafter(close)], DynamicTreePolicy(t_min=0.3, max_nodes=16, measure_costs=False))
    ar = generate(target, prefix, max_new_tokens=24, stop_on_eos=False)
    sp = generate(target, prefix, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
    assert sp.tokens == ar.tokens


class _SlowFirstCall(SmallLMDrafter):
    """A drafter whose first call of a generation is slow, like an LM drafter's prompt prefill."""

    def start(self, run):
        self._first = True
        super().start(run)  # the prefill is the first call

    def score(self, context, extra=()):
        if self._first:
            import time

            time.sleep(0.3)
            self._first = False
        return super().score(context, extra)


def test_prefill_call_does_not_set_the_cost_estimate(tiny_target, tiny_close_drafter):
    """Regression: a prefill-sized first call made the policy stop calling the drafter for good.
    The drafter's catch-up on the prompt is now its own timed step (Drafter.prefill)."""
    drafter = TreeDrafter([_SlowFirstCall(tiny_close_drafter)], DynamicTreePolicy(t_min=0.3, max_nodes=8, calibrate=True))
    out = generate(tiny_target, [1, 2, 3, 4], drafter=drafter, max_new_tokens=20, stop_on_eos=False)
    times = [t for xs in drafter.policy.prices.costs.forward_curves[drafter.names[0]].samples.values() for t in xs]
    assert times and max(times) < 0.1  # the forward-cost fit never saw the prompt's catch-up
    assert sum(s.drafted for s in out.steps) > 0
    assert out.drafter_prefill_time_s >= 0.3  # the slow call happened, in the prefill step
    assert all(s.draft_time_s < 0.3 for s in out.steps)


class _SlowLevels(SmallLMDrafter):
    """A drafter whose every forward costs ~20 target steps of the tiny target."""

    def _start_draft(self, context):
        import time

        time.sleep(0.02)
        return super()._start_draft(context)

    def _forward_nodes(self, tokens, positions, mask):
        import time

        time.sleep(0.02)
        return super()._forward_nodes(tokens, positions, mask)


def test_dynamic_policy_stops_drafting_when_it_does_not_pay(tiny_target, tiny_close_drafter):
    """Do no harm: with a drafter far more expensive than the target, the policy measures its
    cost and drafts only on exploration steps (every 8th here) after the first ones."""
    # the prior prices the drafter low (0.05 of a step), so that it pays against the calibrated
    # verification curve, whose first node on this tiny model costs a sizeable share of a step
    drafter = TreeDrafter([_SlowLevels(tiny_close_drafter)], DynamicTreePolicy(t_min=0.3, max_nodes=8, explore=8, calibrate=True,
                                                                               prior_drafter_cost=0.05))
    out = generate(tiny_target, [1, 2, 3, 4], drafter=drafter, max_new_tokens=48, stop_on_eos=False)
    drafting = [s.step for s in out.steps if s.drafted]
    assert drafting and drafting[0] == 0  # the prior said it might pay: it tried
    later = [s for s in drafting if s >= 2]
    assert all((s + 1) % 8 == 0 for s in later), drafting  # then only the exploration steps
    # and the same drafter, priced as cheap, drafts every step
    cheap = TreeDrafter([_SlowLevels(tiny_close_drafter)], DynamicTreePolicy(t_min=0.3, max_nodes=8, measure_costs=False))
    out = generate(tiny_target, [1, 2, 3, 4], drafter=cheap, max_new_tokens=24, stop_on_eos=False)
    assert all(s.drafted for s in out.steps[:-1])


@pytest.mark.parametrize("double", ["mask_off_by_one", "commit_off_by_one"])
def test_tree_doubles_are_caught_by_greedy_equality(double, tiny_target, tiny_close_drafter):
    """Two tree bugs the chi-square test at CI's sample size barely sees (tests/broken_doubles.py;
    README power table), caught exactly by greedy equality on float64 models: the tree mask off by
    one depth (moves the target's logits at depth >= 2 only slightly), and the target's cache
    keeping a chain's inputs after a path through a later branch (``Verifier.kept``: later steps
    attend to the wrong keys)."""
    from broken_doubles import VERIFIERS

    drafter = TreeDrafter([SmallLMDrafter(tiny_close_drafter)], StaticTreePolicy((2, 2, 1, 1)))
    differ = 0
    for seed in range(6):
        prompt = [seed, 3, 1, 4, 1, 5]
        ar = generate(tiny_target, prompt, max_new_tokens=24, stop_on_eos=False)
        good = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
        bad = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=24, stop_on_eos=False, verifier=VERIFIERS[double])
        assert good.tokens == ar.tokens
        differ += bad.tokens != ar.tokens
    assert differ >= 3, differ



