"""DyTC never loses to the chains it contains (cascade/trees/guard.py), with controlled timings.

A drafter whose siblings are never accepted: an exact copy of the target (greedy: its first
child is always the target's argmax, any other rank never is). Timings are a virtual clock on a
test device where each verified input costs ~9% of a step and the drafter a tenth of one, so
siblings cost real time and return nothing. DyTC must draft chains and run at the best chain's
speed within 3%.

The broken variant: the acceptance record shared between first children and siblings
(``siblings_apart=False``) promises every sibling the first children's ~100%, and without the
guard and the realised-outcome check the policy fills its trees with siblings; the same
comparison catches it. With the same broken record, the realised-outcome check still finds that
trees deliver fewer tokens per second than chains and drafts chains. Every output equals greedy
decoding.
"""

from __future__ import annotations

import pytest

from cascade import generate
from cascade.costs import Device, ForwardShape, VirtualClock
from cascade.drafters import SmallLMDrafter
from cascade.models import perturbed_copy
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy

PROMPTS = [[1, 2, 3, 4], [5, 9, 2], [7, 7, 1, 30, 4], [11, 3], [2, 8, 16, 31, 1, 6]]


def _device(target) -> Device:
    """A forward of the tiny target (2 layers): 1 ms plus 0.1 ms per input; the drafter priced
    with no layers: 0.1 ms plus 0.01 ms per input."""
    shape = ForwardShape.of(target)
    return Device("test device", bandwidth=1e15, peak_flops=2 * shape.weight_count / 1e-4, forward_overhead_s=0.1e-3,
                  layer_overhead_s=0.45e-3, host_step_s=0.0, lookup_s=0.0, kv_bytes=8, source="a test's", measured=False)


class _CheapCopy(SmallLMDrafter):
    """The target's exact copy, priced as a model a tenth of its size without layer overheads."""

    def __init__(self, model, shape: ForwardShape, **kw) -> None:
        super().__init__(model, **kw)
        self._shape = shape

    def forward_shape(self) -> ForwardShape:
        return self._shape


@pytest.fixture(scope="module")
def setup(tiny_target):
    copy = perturbed_copy(tiny_target, noise=0.0, seed=1)
    full = ForwardShape.of(tiny_target)
    cheap = ForwardShape(full.weight_bytes / 10, full.weight_count / 10, 0, full.kv_values_per_position // 2,
                         full.attention_flops_per_position / 2)
    return tiny_target, copy, cheap, _device(tiny_target)


def _run(target, drafter, device, shapes, rounds: int = 3) -> tuple[float, list]:
    """Decode tokens per predicted second over the last round (earlier rounds: warm-up; the
    policy's estimates persist across generations), and the last round's steps."""
    for r in range(rounds):
        tokens, seconds, steps = 0, 0.0, []
        for p in PROMPTS:
            clock = VirtualClock(device, shapes)
            out = generate(target, p, drafter=drafter, max_new_tokens=60, stop_on_eos=False, clock=clock)
            reference = generate(target, p, max_new_tokens=60, stop_on_eos=False)
            assert out.tokens == reference.tokens  # lossless, whatever the shape
            assert out.clock == clock.label and out.clock.startswith("predicted:")
            tokens += len(out.tokens)
            seconds += sum(s.step_time_s for s in out.steps)
            steps += out.steps
    return tokens / seconds, steps


def _dytc(copy, cheap, device, **policy) -> TreeDrafter:
    return TreeDrafter([_CheapCopy(copy, cheap)], DynamicTreePolicy(device=device, max_nodes=24, max_depth=10, **policy))


def _siblings(steps) -> float:
    """Fraction of steps whose verified draft holds a sibling (a node of rank > 1)."""
    trees = [s.tree for s in steps if s.tree is not None]  # (the last step of a call may draft nothing)
    return sum(any(r > 1 for r in t.node_ranks) for t in trees) / len(trees)


def test_dytc_takes_the_chains_shape_and_speed_when_siblings_never_pay(setup):
    target, copy, cheap, device = setup
    shapes = [(copy, cheap)]
    chains = {k: _run(target, _CheapCopy(copy, cheap, k=k), device, shapes, rounds=1)[0] for k in (4, 6, 8, 10)}
    best_chain = max(chains.values())

    dytc, steps = _run(target, _dytc(copy, cheap, device), device, shapes)
    assert dytc >= 0.97 * best_chain, (dytc, chains)
    assert _siblings(steps) <= 0.1  # chain-shaped (siblings only on the realised check's probes)

    # the broken variant: a shared record promises siblings ~100%, no guard, no realised check
    broken, broken_steps = _run(target, _dytc(copy, cheap, device, siblings_apart=False, guard=False, realised_window=0),
                                device, shapes)
    assert _siblings(broken_steps) > 0.5  # it believes its siblings
    assert broken < 0.97 * best_chain, (broken, chains)  # and the same comparison catches it

    # the same broken record under the guarantee: the realised-outcome check turns it to chains
    rescued, rescued_steps = _run(target, _dytc(copy, cheap, device, siblings_apart=False), device, shapes)
    assert _siblings(rescued_steps) <= 0.1
    assert sum(s.tree is not None and s.tree.shape == "chain" for s in rescued_steps) >= 0.8 * len(rescued_steps)
    assert rescued >= 1.3 * broken and rescued >= 0.85 * best_chain, (rescued, broken, chains)


def test_dytc_keeps_trees_that_pay(setup):
    """Where siblings are accepted (a perturbed drafter, flat verification) the guard does not
    strip trees to chains: the realised check finds trees at least as fast and keeps them."""
    target, copy, cheap, device = setup
    flat = Device("flat test device", bandwidth=1e15, peak_flops=1e18, forward_overhead_s=0.1e-3, layer_overhead_s=0.45e-3,
                  host_step_s=0.0, lookup_s=0.0, kv_bytes=8, source="a test's", measured=False)
    close = perturbed_copy(target, noise=0.05, seed=1)
    shapes = [(close, cheap)]
    drafter = TreeDrafter([_CheapCopy(close, cheap)], DynamicTreePolicy(device=flat, max_nodes=24))
    _, steps = _run(target, drafter, flat, shapes)
    assert _siblings(steps) > 0.5
    tree_rate, chain_rate = (drafter.policy.realised.rate(m) for m in ("tree", "chain"))
    assert tree_rate is not None and chain_rate is not None and tree_rate.value >= chain_rate.value


def _no_tree_levels(*args):
    raise AssertionError("the named chain was drafted with tree levels, not the chain's own forwards")


def test_chain_and_tree_modes_hand_the_drafter_cache_over(tiny_target):
    """Steps alternate between the named chain (the drafter's chain path: its cache then holds the
    drafted tokens, synced by prefix) and trees (tree levels, compacted to the accepted path), in
    every order: the output is greedy decoding's and every chain step drafts what the chain
    drafter drafts after the same context."""
    import random

    drafter_lm = perturbed_copy(tiny_target, noise=0.02, seed=3)
    reference = SmallLMDrafter(drafter_lm, k=8, stop_below=0.4)
    for seed in range(3):
        policy = DynamicTreePolicy(chain_stop_below=0.4, chain_k=8, max_depth=10, max_nodes=12, measure_costs=False)
        dytc = TreeDrafter([SmallLMDrafter(drafter_lm, k=1)], policy)
        pick, modes = random.Random(seed), []
        policy.realised.next_mode = lambda: modes.append(pick.choice(("chain", "tree"))) or modes[-1]
        for prompt in PROMPTS:
            modes.clear()
            want = generate(tiny_target, prompt, max_new_tokens=24, stop_on_eos=False)
            got = generate(tiny_target, prompt, drafter=dytc, max_new_tokens=24, stop_on_eos=False)
            assert got.tokens == want.tokens
            assert set(modes) == {"chain", "tree"}
            context, grown = list(prompt), iter(modes)
            for s in got.steps:
                budget = 24 - (len(context) - len(prompt)) - 1  # a step with no room to draft grows no tree
                if budget > 0 and next(grown) == "chain":
                    assert s.draft_tokens == _chain_after(tiny_target, reference, context, budget)
                context += s.emitted_tokens
            assert next(grown, None) is None


def _chain_after(target, chain: SmallLMDrafter, context: list[int], budget: int) -> list[int]:
    """What ``chain`` drafts after ``context`` from a fresh start (its own cache, nothing reused)."""
    from cascade.drafters.base import DraftStart
    from cascade.types import SamplingConfig

    chain.start(DraftStart(target, target.new_cache(), list(context), SamplingConfig(), None, None))
    return chain.propose(context, budget).tokens.tolist()


def test_chain_mode_drafts_the_named_chain_itself(tiny_target):
    """With ``chain_stop_below``, DyTC's chain mode is the chain LMDrafter(k=chain_k,
    stop_below=chain_stop_below) drafts: step by step the same drafted tokens (greedy, float64),
    whatever the prices say."""
    from cascade.models import perturbed_copy

    drafter_lm = perturbed_copy(tiny_target, noise=0.02, seed=3)  # accepted often, not always
    for stop, k in ((0.4, 8), (0.9, 3)):
        chain = SmallLMDrafter(drafter_lm, k=k, stop_below=stop)
        policy = DynamicTreePolicy(chain_stop_below=stop, chain_k=k, max_depth=10, measure_costs=False)
        dytc = TreeDrafter([SmallLMDrafter(drafter_lm, k=1)], policy)
        policy.realised.next_mode = lambda: "chain"  # every step in chain mode
        dytc.drafters[0].tree_level = _no_tree_levels  # ... drafted on the chain's own path
        for prompt in PROMPTS:
            want = generate(tiny_target, prompt, drafter=chain, max_new_tokens=24, stop_on_eos=False)
            got = generate(tiny_target, prompt, drafter=dytc, max_new_tokens=24, stop_on_eos=False)
            assert got.tokens == want.tokens
            assert [s.draft_tokens for s in got.steps] == [s.draft_tokens for s in want.steps]
            assert max(len(s.draft_tokens) for s in got.steps) <= k
    # the priced rule (no chain_stop_below) drafts other chains here: the test can tell them apart
    policy = DynamicTreePolicy(max_depth=10, measure_costs=False)
    dytc = TreeDrafter([SmallLMDrafter(drafter_lm, k=1)], policy)
    policy.realised.next_mode = lambda: "chain"
    chain = SmallLMDrafter(drafter_lm, k=8, stop_below=0.4)
    drafts = lambda d, p: [s.draft_tokens for s in generate(tiny_target, p, drafter=d, max_new_tokens=24,  # noqa: E731
                                                             stop_on_eos=False).steps]
    differ = [drafts(dytc, p) != drafts(chain, p) for p in PROMPTS]
    assert any(differ)


def _modes(check, rates: dict[str, float], steps: int, seed: int, spread: float = 0.5) -> list[str]:
    """Drive ``check`` with noisy outcomes: each step emits 1..9 tokens around the mode's mean
    tokens per second ``rates[mode]`` (seconds ~ 1, noisy by ``spread``); the modes drafted."""
    import random

    rng, modes = random.Random(seed), []
    for _ in range(steps):
        mode = check.next_mode()
        seconds = 1.0 + rng.uniform(-spread, spread)
        tokens = max(1, min(9, round(rng.gauss(rates[mode] * seconds, 1.5))))
        check.record(tokens, seconds)
        modes.append(mode)
    return modes


def test_window_rate_and_its_standard_error():
    from cascade.trees.guard import window_rate

    assert window_rate([]) is None
    one = window_rate([(4, 2.0)])
    assert one.value == 2.0 and one.se == float("inf")
    steady = window_rate([(4, 2.0)] * 10)
    assert steady.value == 2.0 and steady.se == 0.0  # every step at the same rate
    spread = window_rate([(2, 1.0), (6, 1.0)] * 8)
    assert spread.value == 4.0
    # tokens - rate * seconds = -2, +2: sample sd 2.07, / sqrt(16), / mean seconds 1
    assert abs(spread.se - (64 / 15) ** 0.5 / 4) < 1e-12
    wider = window_rate([(1, 1.0), (7, 1.0)] * 8)
    assert wider.se > spread.se


def test_realised_check_falls_back_to_chains_only_when_trees_under_deliver_beyond_noise():
    from cascade.trees.guard import RealisedCheck

    # chains first: trees only every 4th step until they have 4 outcomes
    check = RealisedCheck(window=32, probe=16)
    first = _modes(check, {"tree": 4.0, "chain": 4.0}, 16, seed=0)
    assert first.count("tree") == 4 and first[:3] == ["chain"] * 3
    # trees clearly worse (half the chains' tokens/s): chains, trees on probes only
    check = RealisedCheck(window=32, probe=16)
    modes = _modes(check, {"tree": 2.5, "chain": 5.0}, 400, seed=1)[100:]
    assert modes.count("tree") <= len(modes) / 16 + 1
    # trees clearly better: trees, chains on probes only
    check = RealisedCheck(window=32, probe=16)
    modes = _modes(check, {"tree": 5.0, "chain": 2.5}, 400, seed=2)[100:]
    assert modes.count("chain") <= len(modes) / 16 + 1


def test_a_tie_within_the_noise_drafts_the_same_modes_in_every_run():
    """Equal rates with noisy steps: the mode drafted is trees (chains on probes) in every run,
    not whichever mode the noise favoured; the broken variant (margin 0: the better measured mode,
    whatever the noise) flips its share of chains from run to run."""
    from cascade.trees.guard import RealisedCheck

    def chain_share(seed: int, **check) -> float:
        modes = _modes(RealisedCheck(window=32, probe=16, **check), {"tree": 4.0, "chain": 4.0}, 300, seed)[40:]
        return modes.count("chain") / len(modes)

    shares = [chain_share(seed) for seed in range(8)]
    assert max(shares) - min(shares) < 0.05 and max(shares) < 0.15, shares
    broken = [chain_share(seed, margin=0.0) for seed in range(8)]
    assert max(broken) - min(broken) > 0.15, broken


def test_realised_check_reads_a_probed_mode_from_its_fresh_outcomes_only():
    from cascade.trees.guard import RealisedCheck

    check = RealisedCheck(window=32, probe=4, min_steps=2, max_age=8)
    for tokens in (1, 1):  # two chain outcomes at steps 1 and 2
        check.next_mode()
        check.mode = "chain"
        check.record(tokens, 1.0)
    assert check.rate("chain").value == 1.0
    for _ in range(6):
        check.next_mode()
    assert check.rate("chain") is not None  # step 8: both within the last 8 steps
    check.next_mode()
    check.next_mode()
    assert check.rate("chain") is None  # step 10: both older than max_age
    with pytest.raises(ValueError):
        RealisedCheck(window=32, probe=16, min_steps=4, max_age=32)  # shorter than four probe periods


def test_the_guard_leaves_trees_with_sampled_nodes_whole(setup):
    """Under sampling the guard does not trim trees (which chain pays depends on the tokens
    drawn): with the broken shared record that makes it trim every greedy tree to a chain, every
    sampled tree is verified whole; greedy, the same policy trims."""
    from cascade.types import SamplingConfig

    target, copy, cheap, device = setup
    shapes = {}
    for name, sampling in (("sampled", SamplingConfig(temperature=1.0)), ("greedy", SamplingConfig())):
        drafter = _dytc(copy, cheap, device, siblings_apart=False, realised_window=0)
        steps = []
        for seed, p in enumerate(PROMPTS):
            steps += generate(target, p, drafter=drafter, max_new_tokens=30, sampling=sampling, seed=seed,
                              stop_on_eos=False, clock=VirtualClock(device, [(copy, cheap)])).steps
        shapes[name] = [s.tree.shape for s in steps if s.tree is not None]
    assert shapes["sampled"] and set(shapes["sampled"]) == {"tree"}
    assert "chain" in shapes["greedy"]  # the guard acts on greedy trees (the test can tell)
