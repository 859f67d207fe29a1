"""DyTC's guarantee against the chains it contains: an ex-ante guard and a realised-outcome check.

Every chain DyTC's drafters could draft lies in its policy space, so a tree that is not better
than the best of them is a loss the policy chose. Two checks keep it from choosing it:

1. **The guard** (:func:`best_chain`, :func:`keep_tree`), on every grown tree: the best chain the
   tree contains (a root-to-node path of first children, truncated where it pays most) is valued
   under the same estimates (expected tokens = 1 + the sum of the path's reaches; cost = the
   drafting spent + the verification of its nodes, in target steps); the tree is verified only
   when its expected tokens per cost beat the chain's by more than ``margin`` standard errors of
   the difference (the cost model's) and by at least ``min_gain`` (relative); else the chain is.
2. **The realised-outcome check** (:class:`RealisedCheck`): over a window of steps, the tokens
   each drafting mode ("tree": the policy grows freely; "chain": at most one node per depth)
   actually emitted per second actually spent (measured seconds, or the virtual clock's). When
   trees deliver fewer tokens per second than chains, the policy drafts chains; every
   ``probe``-th step drafts the other mode so both stay measured. Chains are the default: until
   trees have a few outcomes, they are drafted on every fourth probe period only.

What this guarantees, and what not (docs/methods.md): within the estimates, a verified tree is
worth at least the best contained chain; over a window, the mode that delivers fewer tokens per
second is drafted only on probe steps (1 / ``probe`` of them). It does not make DyTC as fast as
a chain of a fixed length tuned after the fact on the same prompts.
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
    sd = math.hypot(tree_value.gain / tree_value.cost ** 2 * tree_value.sd,
                    chain_value.gain / chain_value.cost ** 2 * chain_value.sd)
    return diff > margin * sd and diff > min_gain * chain_value.rate


class RealisedCheck:
    """Tokens per second of each drafting mode over its last ``window`` steps; picks the mode.

    Chains are the default: until trees have ``min_steps`` outcomes they are drafted on every
    ``max(2, probe // 4)``-th step only (so their first outcomes come after the acceptance
    estimates have learnt from chains, and few steps are spent on trees grown from priors); then
    the mode that delivered more tokens per second is drafted, the other every ``probe``-th step."""

    def __init__(self, window: int = 32, probe: int = 16, min_steps: int = 4) -> None:
        if window < 1 or probe < 2 or min_steps < 1:
            raise ValueError(f"invalid realised-outcome check: window {window}, probe {probe}, min_steps {min_steps}")
        self.window, self.probe, self.min_steps = window, probe, min_steps
        self.outcomes = {m: deque(maxlen=window) for m in MODES}  # (tokens, seconds) per step
        self.steps = 0
        self.mode = "chain"

    def rate(self, mode: str) -> float | None:
        out = self.outcomes[mode]
        if len(out) < self.min_steps:
            return None
        seconds = sum(s for _, s in out)
        return sum(t for t, _ in out) / seconds if seconds > 0 else None

    def next_mode(self) -> str:
        """The mode of the next step (see the class docstring; chains on a tie)."""
        self.steps += 1
        tree, chain = self.rate("tree"), self.rate("chain")
        measured = tree is not None and chain is not None
        best = "tree" if measured and tree > chain else "chain"
        other = "chain" if best == "tree" else "tree"
        period = self.probe if measured else max(2, self.probe // 4)
        self.mode = other if self.steps % period == 0 else best
        return self.mode

    def record(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.outcomes[self.mode].append((tokens, seconds))

    def snapshot(self) -> dict[str, float | None]:
        return {f"{m}_tokens_per_s": None if self.rate(m) is None else round(self.rate(m), 3) for m in MODES}
