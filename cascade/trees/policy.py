"""The tree-policy protocol: how a ``TreeDrafter`` asks a policy to grow a tree and learn.

A policy is a small stateful object (its estimates persist across steps and prompts: they
describe the models, not a prompt):

``setup(names, calls)``      once the drafters are known (check them, create estimates)
``start(target)``            before each generation (e.g. time target forwards once)
``grow(tree, calls, budget)``   grow ``tree`` through ``calls``; return the nodes to verify
                             (closed under ancestors, increasing), never deeper than ``budget``
``observe(nodes, result, verify_time_s)``   the verified nodes' judgements and the forward's time
``estimates()``              what it acted on (``PolicyEstimates``), logged per step
``budget``, ``kind``         most nodes per tree; a short name ("static", "reranked", "dytc")
``last_shape``               "tree", or "chain" when the last grow verified one chain on purpose
"""

from __future__ import annotations

from cascade.models.lm import CausalLM
from cascade.trees.acceptance import NodeAcceptance
from cascade.trees.growth import LevelCalls, Node, Tree
from cascade.types import PolicyEstimates, VerifyResult


class TreePolicy:
    """Base of the policies: node acceptance learned from every verification."""

    kind = "tree"
    prior: tuple[float, float] = (1.0, 1.0)
    depth_prior: str = "above"  # NodeAcceptance: a depth's α̂ prior centred on the depth above ("flat": the prior)
    siblings_apart: bool = True  # NodeAcceptance: ranked siblings' confidence buckets learned apart from first children's
    ranked_first = False  # the policy takes ranked children from the first drafter, which must be an LM drafter
    last_shape = "tree"  # what the last grow chose to verify: "tree", or "chain" (DyTC's guard / realised check)

    def setup(self, names: list[str], calls: LevelCalls) -> None:
        if self.ranked_first and not calls.is_lm(0):
            raise TypeError(f"a {self.kind} tree's first drafter must be an LM drafter (it provides ranked children)")
        self.acceptance = NodeAcceptance(names, self.prior, self.depth_prior, self.siblings_apart)

    def start(self, target: CausalLM) -> None:
        pass

    def grow(self, tree: Tree, calls: LevelCalls, budget: int) -> list[int]:
        raise NotImplementedError

    def observe(self, nodes: list[Node], result: VerifyResult, verify_time_s: float | None) -> None:
        self.acceptance.observe(nodes, result.judgements)

    def estimates(self) -> PolicyEstimates:
        return PolicyEstimates(alpha=self.acceptance.snapshot())

    @property
    def budget(self) -> int:
        raise NotImplementedError
