"""DyTC's guarantee against the chains it contains: an ex-ante guard and a realised-outcome check.

Every chain DyTC's drafters could draft lies in its policy space, so a tree that is not better
than the best of them is a loss the policy chose. Two checks keep it from choosing it:

1. **The guard** (:func:`best_chain`, :func:`keep_tree`), on every grown tree: the best chain the
   tree contains (a root-to-node path of first children, truncated where it pays most) is valued
   under the same estimates (expected tokens = 1 + the sum of the path's reaches; cost = the
   drafting spent + the verification of its nodes, in target steps); the tree is verified only
   when its expected tokens per cost beat the chain's by more than ``margin`` standard errors of
   the difference (the cost model's) and by at least ``min_gain`` (relative); else the chain is.
   Trees of deterministic nodes only (greedy): under sampling which chain pays depends on the
   tokens drawn, and a sampled node kept or dropped by its value is no longer drawn from its q.
2. **The realised-outcome check** (:class:`RealisedCheck`): over a window of steps, the tokens
   each drafting mode ("tree": the policy grows freely; "chain": at most one node per depth)
   actually emitted per second actually spent (measured seconds, or the virtual clock's), with
   the standard error of that rate. Chains come first: until trees have a few outcomes they are
   drafted on every fourth probe period only. Then trees are drafted unless they deliver fewer
   tokens per second than chains by more than ``margin`` standard errors of the difference
   (then chains); every ``probe``-th step drafts the other mode so both stay measured.

What this guarantees, and what not (docs/methods.md): within the estimates, a verified tree is
worth at least the best contained chain; over a window, the mode that delivers fewer tokens per
second by more than the noise of its window is drafted only on probe steps (1 / ``probe`` of
them). A difference within the noise leaves trees drafted, so the mode does not flip with the
noise of a shared host (priced by a roofline, DyTC drafted the same rounds in two runs; priced
from measured timings its trees still follow the host: docs/results.md). It does not make
DyTC as fast as a chain of a fixed length tuned after the fact on the same prompts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from cascade.trees.growth import Tree

MODES = ("tree", "chain")


@dataclass(frozen=True)
class Valued:
    """A set of nodes to verify, valued in target steps."""

    nodes: list[int]  # increasing, closed under ancestors
    gain: float  # expected tokens (1 + the sum of the nodes' reaches)
    cost: float  # drafting spent + verification of len(nodes) nodes
    sd: float = 0.0  # standard error of the cost

    @property
    def rate(self) -> float:
        return self.gain / self.cost


def best_chain(tree: Tree, drafting: float, verify_cost) -> Valued:
    """The best chain of first children in ``tree``: every root-to-node path whose nodes are all
    rank-1 children, valued with the drafting already spent and ``verify_cost(n) -> (steps, sd)``
    for n nodes (n + 1 inputs); the empty chain (plain decoding) included."""
    base, base_sd = verify_cost(0)
    best = Valued([], 1.0, drafting + base, base_sd)
    for x in range(len(tree.nodes)):
        path, j = [], x
        while j >= 0 and tree.nodes[j].rank == 1:
            path.append(j)
            j = tree.nodes[j].parent
        if j >= 0:
            continue  # a sibling on the way: not a chain
        path.reverse()
        cost, sd = verify_cost(len(path))
        value = Valued(path, 1.0 + sum(tree.nodes[i].reach for i in path), drafting + cost, sd)
        if value.rate > best.rate:
            best = value
    return best


def keep_tree(tree_value: Valued, chain_value: Valued, margin: float, min_gain: float) -> bool:
    """Whether the tree beats the chain by more than ``margin`` standard errors of the rates'
    difference and by ``min_gain`` of the chain's rate."""
    diff = tree_value.rate - chain_value.rate
    return (beyond_noise(diff, margin, tree_value.gain / tree_value.cost ** 2 * tree_value.sd,
                         chain_value.gain / chain_value.cost ** 2 * chain_value.sd)
            and diff > min_gain * chain_value.rate)


def beyond_noise(diff: float, margin: float, *se: float) -> bool:
    """Whether a difference of two estimates exceeds ``margin`` standard errors of it (``se``:
    the estimates' own, independent)."""
    return diff > margin * math.hypot(*se)


@dataclass(frozen=True)
class Rate:
    """Tokens per second over a window of steps, and its standard error."""

    value: float
    se: float


def window_rate(outcomes) -> Rate | None:
    """The ratio estimate sum(tokens) / sum(seconds) over ``outcomes`` ((tokens, seconds) per
    step) and its standard error (the ratio estimator's: the spread of tokens - rate * seconds
    over the steps, divided by the mean step's seconds); infinite with one step."""
    n = len(outcomes)
    seconds = sum(s for _, s in outcomes)
    if n == 0 or seconds <= 0:
        return None
    rate = sum(t for t, _ in outcomes) / seconds
    if n < 2:
        return Rate(rate, math.inf)
    spread = sum((t - rate * s) ** 2 for t, s in outcomes) / (n - 1)
    return Rate(rate, math.sqrt(spread / n) / (seconds / n))


class RealisedCheck:
    """Tokens per second of each drafting mode over its last ``window`` steps; picks the mode.

    Chains come first: until trees have ``min_steps`` outcomes they are drafted on every
    ``max(2, probe // 4)``-th step only (so their first outcomes come after the acceptance
    estimates have learnt from chains, and few steps are spent on trees grown from priors). Then
    trees are drafted unless chains delivered more tokens per second by more than ``margin``
    standard errors of the difference, and the other mode every ``probe``-th step. A tie within
    the noise goes to trees, the policy's own choice, rather than to whichever mode the host's
    noise favoured last: the mode drafted does not flip with that noise."""

    def __init__(self, window: int = 32, probe: int = 16, min_steps: int = 4, margin: float = 2.0,
                 max_age: int | None = None) -> None:
        # a probed mode gets an outcome every probe-th step: its window must hold min_steps of them
        max_age = max(4 * window, 2 * probe * min_steps) if max_age is None else max_age
        if window < 1 or probe < 2 or min_steps < 2 or not margin >= 0 or max_age < probe * min_steps:
            raise ValueError(f"invalid realised-outcome check: window {window}, probe {probe}, min_steps {min_steps}, "
                             f"margin {margin}, max_age {max_age} (at least probe * min_steps)")
        self.window, self.probe, self.min_steps, self.margin, self.max_age = window, probe, min_steps, margin, max_age
        self.outcomes = {m: deque(maxlen=window) for m in MODES}  # (step, tokens, seconds) per step
        self.steps = 0
        self.mode = "chain"

    def rate(self, mode: str) -> Rate | None:
        """The mode's rate over its last ``window`` outcomes of the last ``max_age`` steps (by
        default the larger of 4 windows and 2 probe periods' worth of ``min_steps``), once it
        has ``min_steps`` of them. A mode drafted on probes only is read from its fresh probes: an
        unlucky window of it ages out instead of deciding the mode for hundreds of steps."""
        out = [(t, s) for step, t, s in self.outcomes[mode] if step > self.steps - self.max_age]
        return window_rate(out) if len(out) >= self.min_steps else None

    def trees_under_deliver(self, tree: Rate, chain: Rate) -> bool:
        return beyond_noise(chain.value - tree.value, self.margin, tree.se, chain.se)

    def next_mode(self) -> str:
        """The mode of the next step (see the class docstring)."""
        self.steps += 1
        tree, chain = self.rate("tree"), self.rate("chain")
        if tree is None or chain is None:
            best, period = "chain", max(2, self.probe // 4)
        else:
            best, period = ("chain" if self.trees_under_deliver(tree, chain) else "tree"), self.probe
        other = "chain" if best == "tree" else "tree"
        self.mode = other if self.steps % period == 0 else best
        return self.mode

    def record(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.outcomes[self.mode].append((self.steps, tokens, seconds))

    def snapshot(self) -> dict[str, float | None]:
        """Tokens per second of each mode and its standard error (None until measured)."""
        out: dict[str, float | None] = {}
        for m in MODES:
            r = self.rate(m)
            out[f"{m}_tokens_per_s"] = None if r is None else round(r.value, 3)
            out[f"{m}_tokens_per_s_se"] = None if r is None or not math.isfinite(r.se) else round(r.se, 3)
        return out
