"""EAGLE-2's reranked tree: expand the ``top_k`` nodes of the newest level with the highest
global score (the product of the drafter's probabilities along the path), ``top_k`` ranked
children each, for ``depth`` levels; then verify only the ``max_nodes`` nodes with the highest
score (a set closed under ancestors: a score never grows down a path). Children are always
ranked (deterministic): choosing sampled siblings by their own scores would bias them."""

from __future__ import annotations

from dataclasses import dataclass

from cascade.trees.growth import LevelCalls, Tree
from cascade.trees.policy import TreePolicy


@dataclass
class RerankedTreePolicy(TreePolicy):
    top_k: int = 4  # nodes expanded per level, and children per expanded node
    depth: int = 5  # levels grown
    max_nodes: int = 16  # nodes verified (the highest global scores)
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of the logged α̂
    kind = "reranked"
    ranked_first = True

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or self.max_nodes < 1:
            raise ValueError(f"invalid reranked tree policy {self}")

    @property
    def budget(self) -> int:
        return self.max_nodes

    def grow(self, tree: Tree, calls: LevelCalls, budget: int) -> list[int]:
        frontier = [-1]
        for _ in range(min(self.depth, budget)):
            logits = calls.forward(tree, 0, frontier)
            level = []
            for x in frontier:
                for rank, (token, conf) in enumerate(calls.ranked(tree, x, logits[x], self.top_k), start=1):
                    child = tree.add(x, drafter=0, rank=rank, token=token, q=None, reach=0.0, conf=conf)
                    tree.nodes[child].reach = tree.nodes[child].score  # the drafter's own estimate of the path
                    level.append(child)
            frontier = sorted(level, key=lambda j: -tree.nodes[j].score)[: self.top_k]
        best = sorted(range(len(tree.nodes)), key=lambda j: (-tree.nodes[j].score, tree.nodes[j].depth, j))[: self.max_nodes]
        return sorted(best)
