"""``TreeDrafter``: token trees grown level by level by a tree policy, verified in one forward.

``TreeDrafter(drafters, policy)`` grows a token tree below the last committed token and returns
it as one ``DraftBlock`` with ``parents`` (see ``cascade.tree_structure``); ``cascade.generate`` verifies
it in one tree-attention forward. What the tree looks like is the policy's business
(``cascade.trees``: ``StaticTreePolicy``, ``RerankedTreePolicy`` (EAGLE-2),
``DynamicTreePolicy`` (CAS-Spec's DyTC, priced per level)); this class keeps the rest:

* the drafters' level calls (``cascade.trees.growth.LevelCalls``): an LM drafter (small LM,
  quantized LM, layer skip, Kangaroo) scores **all the nodes it expands at a depth in one
  forward**, so it costs at most one forward per depth (``TreeStats.drafter_forwards``); any
  other drafter (n-gram, Token Recycling, suffix, a cascade) proposes one token per node;
* the block: tokens, parents, and q row by row (a deterministic node's row is one-hot);
* the commit: after verification each LM drafter's cache is compacted to the accepted path
  (``tree_commit``), and the policy learns from the judged nodes and the forward's time.

Each LM drafter's catch-up on the prompt happens in ``start``, outside the tree, so no cost
estimate ever includes it.
"""

from __future__ import annotations

import torch

from cascade.drafters.base import ChecksTarget, Drafter, DraftStart, Outcome, check_target, shared_hidden_layer
from cascade.models.lm import CausalLM, HiddenLayers
from cascade.sampling import one_hot_rows
from cascade.trees.dynamic import DynamicTreePolicy
from cascade.trees.policy import TreePolicy
from cascade.trees.reranked import RerankedTreePolicy
from cascade.trees.static import StaticTreePolicy
from cascade.trees.growth import LevelCalls, Node, Tree
from cascade.types import DraftBlock, DrafterInfo, TreeStats

__all__ = ["DynamicTreePolicy", "RerankedTreePolicy", "StaticTreePolicy", "TreeDrafter"]


class TreeDrafter(Drafter, ChecksTarget):
    def __init__(self, drafters: list[Drafter], policy: TreePolicy | None = None, name: str | None = None) -> None:
        self.drafters = list(drafters)
        if not self.drafters:
            raise ValueError("a tree drafter needs at least one drafter")
        self.policy = policy or DynamicTreePolicy()
        self.names = [f"{i}:{d.name}" for i, d in enumerate(self.drafters)]
        self.calls = LevelCalls(self.drafters)
        self.policy.setup(self.names, self.calls)
        self.name = name or f"{self.kind}({', '.join(d.name for d in self.drafters)})"
        self._verified: list[Node] = []  # the nodes of the last proposal, in block order
        self._verified_ids: list[int] = []  # their indices in that proposal's tree (what the drafters fed)
        self._started: set[int] = set()  # LM drafters that started on that tree (their caches hold it)
        shared_hidden_layer(self.drafters, "tree drafters")  # refuse drafters needing different layers now

    @property
    def hidden_layer(self) -> HiddenLayers:
        return shared_hidden_layer(self.drafters, "tree drafters")

    @property
    def kind(self) -> str:
        return f"{self.policy.kind}_tree"

    @property
    def k(self) -> int:
        """Most nodes per tree."""
        return self.policy.budget

    def describe(self) -> DrafterInfo:
        return DrafterInfo(self.kind, self.name, self.k, parts=[d.describe() for d in self.drafters])

    # ---- protocol ---------------------------------------------------------------------------
    drafts_trees = True

    def check_compatible(self, target: CausalLM) -> None:
        for d in self.drafters:
            check_target(d, target)

    def start(self, run: DraftStart) -> None:
        """The policy's estimates persist across generations (they describe the models, not a prompt)."""
        super().start(run)
        for d in self.drafters:
            d.start(run.part(d))
        self.calls.start(run.sampling, run.generator)
        self._verified, self._verified_ids, self._started = [], [], set()
        self.policy.start(run.target)

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        tree = Tree(context)
        try:
            keep = self.policy.grow(tree, self.calls, budget)
        finally:
            for i in tree.started:
                self.drafters[i].tree_end()
        self._started = set(tree.started)
        return self._block(tree, keep)

    def _block(self, tree: Tree, keep: list[int]) -> DraftBlock:
        """The verified tree: the grown nodes ``keep`` (closed under ancestors, increasing)."""
        index = {j: b for b, j in enumerate(keep)}
        nodes = [tree.nodes[j] for j in keep]
        self._verified, self._verified_ids = nodes, keep
        parents = [-1 if n.parent < 0 else index[n.parent] for n in nodes]
        tokens = torch.tensor([n.token for n in nodes], dtype=torch.long)  # [n]
        q = None
        if any(n.q is not None for n in nodes):
            ref = next(n.q for n in nodes if n.q is not None)
            q = torch.stack([n.q if n.q is not None else one_hot_rows([n.token], ref)[0] for n in nodes])  # [n, V]
        stats = TreeStats(
            node_drafters=[self.names[n.drafter] for n in nodes],
            expected_accepted=round(sum(n.reach for n in nodes), 4),
            drafter_forwards=tree.forwards,
            drafter_seconds=self._seconds_by_drafter(tree),
            estimates=self.policy.estimates(),
            node_ranks=[n.rank for n in nodes],
            node_alpha=[round(n.reach / tree.reach(n.parent), 4) if tree.reach(n.parent) > 0 else 0.0 for n in nodes],
            shape=self.policy.last_shape,
        )
        return DraftBlock(tokens, q, self.name, parents=parents, tree=stats)

    def _seconds_by_drafter(self, tree: Tree) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for t in tree.timings:
            seconds[self.names[t.drafter]] = seconds.get(self.names[t.drafter], 0.0) + t.seconds
        return seconds

    def observe(self, outcome: Outcome) -> None:
        """The policy learns from the judged nodes and the forward's time; each LM drafter's cache
        is compacted to the accepted path; every drafter observes the step."""
        self.policy.observe(self._verified, outcome.result, outcome.verify_time_s)
        path = [self._verified_ids[b] for b in outcome.result.path] if self._verified else []
        for i in self._started:
            self.drafters[i].tree_commit(path)
        for d in self.drafters:
            d.observe(outcome.part(d))
        self._verified, self._started = [], set()
