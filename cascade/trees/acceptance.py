"""α̂ of tree nodes, learned from verification: what every tree policy's node reach is made of.

Four families of keys per drafter (``cascade.estimators.AcceptanceTable``, censoring-aware):
``depth{d}`` (a drafter's first child at depth d, its prior centred on depth d - 1's estimate),
``rank{r}`` (its r-th sampled sibling), ``conf{b}`` (a deterministic first child whose drafter
probability falls in bucket b, calibrated online; the prior is a calibrated drafter, worth two
observations) and ``sibling_conf{b}`` (the same for a deterministic child below the first).

First children and their siblings are calibrated apart: at the same drafter probability a
ranked sibling is accepted far less often than a first child (on HumanEval the int4 x int8
0.5B's siblings in DyTC's trees were accepted 5-10% of the time, judged by buckets learned
mostly from first children), and a shared bucket made every sibling look worth its node.
"""

from __future__ import annotations

import bisect

from cascade.estimators import AcceptanceTable
from cascade.trees.growth import Node
from cascade.types import ACCEPTED, REJECTED, AlphaEstimate

# confidence buckets of a deterministic child (the drafter's probability of its token)
CONF_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)
CONF_MIDS = (0.025, 0.1, 0.225, 0.4, 0.6, 0.775, 0.9, 0.975)
DEPTH_PRIORS = ("above", "flat")  # a depth's α̂ prior: centred on the depth above, or the table's own


def conf_bucket(conf: float) -> int:
    return bisect.bisect_right(CONF_EDGES, conf)


def _conf_prior(bucket: int) -> tuple[float, float]:
    return 2 * CONF_MIDS[bucket], 2 * (1 - CONF_MIDS[bucket])


class NodeAcceptance:
    """α̂ per drafter (by its name in the tree: ``names[i]``)."""

    def __init__(self, names: list[str], prior: tuple[float, float] = (1.0, 1.0), depth_prior: str = "above",
                 siblings_apart: bool = True) -> None:
        if depth_prior not in DEPTH_PRIORS:
            raise ValueError(f"depth_prior must be one of {DEPTH_PRIORS}, got {depth_prior!r}")
        self.names, self.depth_prior, self.siblings_apart = names, depth_prior, siblings_apart
        self.table = AcceptanceTable(prior=tuple(prior))

    def first_child(self, i: int, depth: int) -> float:
        """α̂ of drafter i's first child at ``depth``: each depth's Beta posterior with its prior
        centred on the estimate of the depth above (same strength as the table's prior), so an
        unseen depth takes the one above and a depth judged once or twice stays near it.

        Acceptance changes slowly with depth. With a flat prior per depth, one judged node at a
        new depth put its α̂ at 2/3 (Beta(1, 1) + one success) below a well-measured 0.85-0.9
        above it; the policy then never paid for that depth again and never learned it (a DyTC
        tree over the int8 0.5B stopped at depth 3, where the same drafter's chain is accepted
        0.84-0.93 per depth). ``depth_prior="flat"`` keeps that behaviour (the table's prior at
        every depth; an unseen depth takes the deepest seen one above it), for comparison."""
        name = self.names[i]
        if self.depth_prior == "flat":
            for d in range(depth, 0, -1):
                if self.table.seen(name, f"depth{d}"):
                    return self.table.mean(name, f"depth{d}")
            return self.table.mean(name, f"depth{depth}")
        a0, b0 = self.table.prior
        strength = a0 + b0
        mean = a0 / strength
        for d in range(1, depth + 1):
            accepted, judged = self.table.counts(name, f"depth{d}")
            mean = (accepted + strength * mean) / (judged + strength)
        return mean

    def sibling(self, i: int, depth: int, rank: int) -> float:
        """P(the rank-th sampled child is accepted | its parent is reached), from estimates only
        (decided before it is drawn: its inclusion must not depend on its own value)."""
        def alpha(r: int) -> float:
            return self.first_child(i, depth) if r == 1 else self.table.mean(self.names[i], f"rank{r}")

        value = alpha(rank)
        for r in range(1, rank):
            value *= 1 - alpha(r)
        return value

    def confident(self, i: int, conf: float, rank: int = 1) -> float:
        """α̂ of a deterministic child whose drafter probability is ``conf``, the ``rank``-th
        child of its parent from drafter i: for ranked children the events "the target's argmax
        is this token" are disjoint, so values add."""
        b = conf_bucket(conf)
        return self.table.mean(self.names[i], self._conf_key(b, rank), prior=_conf_prior(b))

    def _conf_key(self, bucket: int, rank: int) -> str:
        return f"conf{bucket}" if rank == 1 or not self.siblings_apart else f"sibling_conf{bucket}"

    def observe(self, nodes: list[Node], judgements: list[int]) -> None:
        """Learn from the judged nodes; unjudged ones (below a rejection) are not failures."""
        for node, verdict in zip(nodes, judgements):
            if verdict not in (ACCEPTED, REJECTED):
                continue
            name, ok = self.names[node.drafter], verdict == ACCEPTED
            if node.rank == 1:
                self.table.update(name, f"depth{node.depth}", ok)
            elif node.q is not None:
                self.table.update(name, f"rank{node.rank}", ok)
            if node.conf is not None:
                b = conf_bucket(node.conf)
                self.table.update(name, self._conf_key(b, node.rank), ok, prior=_conf_prior(b))

    def snapshot(self) -> dict[str, dict[str, AlphaEstimate]]:
        return self.table.snapshot()
