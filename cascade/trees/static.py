"""Static trees: every node at depth d - 1 gets ``widths[d - 1]`` children from the first drafter
(an LM drafter: one forward per depth); ``widths=[1] * k`` is a chain. Children are the
drafter's ranked tokens (deterministic runs) or independent draws from its processed q."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascade.trees.growth import LevelCalls, Tree
from cascade.trees.policy import TreePolicy


@dataclass
class StaticTreePolicy(TreePolicy):
    widths: tuple[int, ...] = (2, 2, 1, 1)
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of the logged α̂ (node reach)
    kind = "static"
    ranked_first = True

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"static tree widths must be positive, got {self.widths}")

    @property
    def budget(self) -> int:
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def grow(self, tree: Tree, calls: LevelCalls, budget: int) -> list[int]:
        frontier = [-1]
        for width in self.widths[:budget]:
            if not frontier:
                break
            logits = calls.forward(tree, 0, frontier)
            frontier = [c for x in frontier for c in self._children(tree, calls, x, logits[x], width)]
        return list(range(len(tree.nodes)))

    def _children(self, tree: Tree, calls: LevelCalls, node: int, logits: torch.Tensor, count: int) -> list[int]:
        """``count`` children of ``node``, their reach from the learned α̂."""
        if calls.deterministic(0):
            return [tree.add(node, drafter=0, rank=rank, token=token, q=None,
                             reach=tree.reach(node) * self.acceptance.confident(0, conf, rank), conf=conf)
                    for rank, (token, conf) in enumerate(calls.ranked(tree, node, logits, count), start=1)]
        q = calls.q(logits)  # [V]
        depth = tree.depth(node) + 1
        return [tree.add(node, drafter=0, rank=rank, token=calls.draw(q), q=q,
                         reach=tree.reach(node) * self.acceptance.sibling(0, depth, rank))
                for rank in range(1, count + 1)]
