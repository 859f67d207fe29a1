"""Tree drafting: static trees and CAS-Spec's Dynamic Tree Cascade (DyTC) policy.

``TreeDrafter(drafters, policy)`` grows a token tree below the last committed token and returns
it as one ``DraftBlock`` with ``parents`` (see ``cascade.tree``); ``cascade.generate`` verifies
it in one tree-attention forward. The tree is grown by *expansions*: (node, drafter, rank) adds
one child of ``node`` proposed by ``drafter``:

* an LM drafter (``LMDrafter``: small LM, quantized LM, layer skip, Kangaroo) is asked once per
  node for its next-token logits; greedy runs take its rank-r token (deterministic, one-hot q),
  sampled runs draw each child independently from its processed distribution (q reported);
* any other drafter (n-gram, a cascade) proposes one token for the node (rank 1 only).

Policies:

``StaticTreePolicy(widths)``
    breadth first: every node at depth d - 1 gets ``widths[d - 1]`` children from the first
    drafter (``widths=[1] * k`` is a chain).
``DynamicTreePolicy(t_min, max_nodes, ...)``
    keeps the frontier of candidate expansions and repeatedly takes the best one by value per
    cost until the best falls under ``t_min`` or ``max_nodes`` is reached:

        value = reach(node) * prod_{j < r} (1 - α̂_j) * α̂_r      expected accepted tokens it adds
        cost  = [ĉ_drafter if node not yet scored by it] + Δverify   in target-step units

    reach(node) is the product of the estimated acceptances along its path; α̂_1 is the
    drafter's acceptance at the child's depth, α̂_r (r > 1) its acceptance at sibling rank r;
    Δverify is the fitted growth of verification time per tree node, so the policy stops
    growing where a bigger tree costs more in verification than it is expected to return
    (the seed's rule: stop a branch when α̂_d / ĉ_d * prod α̂_j < t_min).

Estimates (``cascade.estimators``) are updated from every verification (the judged nodes and the
verification forward's time, both handed to ``observe``) and logged per step in the block's
``TreeStats``. Each LM drafter's catch-up on the prompt happens in ``prefill``, outside the
expansions, so no drafter cost estimate ever includes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cascade.drafters.base import Drafter, shared_hidden_layer
from cascade.drafters.lm_base import LMDrafter
from cascade.estimators import AcceptanceTable, DrafterCost, VerifyCost
from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.tree import path_to
from cascade.types import ACCEPTED, REJECTED, DraftBlock, DrafterInfo, SamplingConfig, TreeStats, VerifyResult


@dataclass
class StaticTreePolicy:
    widths: tuple[int, ...] = (2, 2, 1, 1)

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"static tree widths must be positive, got {self.widths}")


@dataclass
class DynamicTreePolicy:
    t_min: float = 0.7  # stop when the best expansion's expected tokens per target-step of cost is below
    max_nodes: int = 32
    max_depth: int = 10
    max_rank: int = 4  # most children one LM drafter may add to one node
    prior_drafter_cost: float = 0.2  # ĉ before a drafter is measured, in target steps
    prior_verify_slope: float = 0.02  # Δverify per node before it is fitted, in target steps
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of every α̂

    def __post_init__(self) -> None:
        if self.t_min < 0 or self.max_nodes < 1 or self.max_depth < 1 or self.max_rank < 1:
            raise ValueError(f"invalid dynamic tree policy {self}")


@dataclass
class _Node:
    token: int
    parent: int  # node index, -1 = root
    depth: int
    drafter: int  # index into TreeDrafter.drafters
    rank: int
    q: torch.Tensor | None
    reach: float  # estimated probability that the path to this node is accepted


class TreeDrafter(Drafter):
    def __init__(self, drafters: list[Drafter], policy: StaticTreePolicy | DynamicTreePolicy | None = None,
                 calibrate: bool = False, name: str | None = None) -> None:
        self.drafters = list(drafters)
        if not self.drafters:
            raise ValueError("a tree drafter needs at least one drafter")
        self.policy = policy or DynamicTreePolicy()
        if isinstance(self.policy, StaticTreePolicy) and not isinstance(self.drafters[0], LMDrafter):
            raise TypeError("a static tree's first drafter must be an LM drafter (it provides ranked children)")
        self.calibrate = calibrate
        self.names = [f"{i}:{d.name}" for i, d in enumerate(self.drafters)]
        kind = "static" if isinstance(self.policy, StaticTreePolicy) else "dytc"
        self.name = name or f"{kind}_tree({', '.join(d.name for d in self.drafters)})"
        prior = getattr(self.policy, "prior", (1.0, 1.0))
        self.alpha = AcceptanceTable(prior=tuple(prior))
        self.dcost = DrafterCost()
        self.vcost = VerifyCost()
        self._calibrated = False
        self._last: list[_Node] = []
        self.hidden_layer = shared_hidden_layer(self.drafters, "tree drafters")

    @property
    def kind(self) -> str:
        return "static_tree" if isinstance(self.policy, StaticTreePolicy) else "dytc_tree"

    @property
    def budget(self) -> int:
        """Most nodes per tree."""
        if isinstance(self.policy, StaticTreePolicy):
            total, level = 0, 1
            for w in self.policy.widths:
                level *= w
                total += level
            return total
        return self.policy.max_nodes

    def describe(self) -> DrafterInfo:
        return DrafterInfo(self.kind, self.name, self.budget, parts=[d.describe() for d in self.drafters])

    # ---- protocol ---------------------------------------------------------------------------
    def check_compatible(self, target: CausalLM) -> None:
        for d in self.drafters:
            d.check_compatible(target)

    def bind(self, target: CausalLM, cache) -> None:
        self.target = target
        for d in self.drafters:
            d.bind(target, cache)

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Estimates persist across generations (they describe the models, not a prompt)."""
        super().reset(sampling, generator)
        for d in self.drafters:
            d.reset(sampling, generator)
        if self.calibrate and not self._calibrated:
            self._calibrate()

    def prefill(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        for d in self.drafters:
            d.prefill(prompt, hidden if d.hidden_layer is not None else None)

    def _calibrate(self) -> None:
        """Time target forwards of a few sizes on a scratch cache (fits Δverify before decoding)."""
        cache = self.target.new_cache()
        self.target.forward([0] * 64, cache)
        for n in (1, 4, 8, 16, 32, 1, 16):
            t0 = time.perf_counter()
            self.target.forward([0] * n, cache)
            self.vcost.update(n, time.perf_counter() - t0)
            self.target.crop(cache, 64)
        self._calibrated = True

    # ---- estimates --------------------------------------------------------------------------
    def _alpha(self, drafter: int, depth: int, rank: int) -> float:
        """α̂ of drafter's rank-``rank`` child at ``depth``; an unseen depth borrows the deepest
        seen one above it (acceptance changes slowly with depth), an unseen rank the prior."""
        name = self.names[drafter]
        if rank > 1:
            return self.alpha.mean(name, f"rank{rank}")
        for d in range(depth, 0, -1):
            if self.alpha.seen(name, f"depth{d}"):
                return self.alpha.mean(name, f"depth{d}")
        return self.alpha.mean(name, f"depth{depth}")

    def _step_cost(self) -> float:
        return self.vcost.predict(1) or 0.0

    def _costs(self) -> tuple[dict[int, float], float]:
        """Drafter call cost and Δverify per node, in target-step units."""
        unit = self._step_cost()
        pol = self.policy
        fit = self.vcost.fit()
        slope = pol.prior_verify_slope if fit is None or unit <= 0 or len(self.vcost.obs) < 3 else fit[1] / unit
        dc = {}
        for i, name in enumerate(self.names):
            s = self.dcost.get(name)
            dc[i] = pol.prior_drafter_cost if s is None or unit <= 0 else s / unit
        return dc, slope

    # ---- growing the tree -------------------------------------------------------------------
    def _scores(self, i: int, context: list[int]) -> dict:
        """Drafter i's proposal at a node: LM logits and ranking, or one generic token."""
        d = self.drafters[i]
        t0 = time.perf_counter()
        if isinstance(d, LMDrafter):
            logits = d.score(context)[-1]  # [V]
            entry = {"logits": logits, "order": None, "q": None}
            if not self.sampling.greedy and d.sample:
                entry["q"] = logits_to_probs(logits, self.sampling)  # [V]
        else:
            block = d.propose(context, 1)
            entry = {"token": int(block.tokens[0]) if block.k else None,
                     "q": None if block.q is None or not block.k else block.q[0]}
        self.dcost.update(self.names[i], time.perf_counter() - t0)
        return entry

    def _child(self, entry: dict, i: int, rank: int, taken: set[int]) -> tuple[int | None, torch.Tensor | None, int]:
        """The token of drafter i's next child at a node (skipping deterministic duplicates)."""
        d = self.drafters[i]
        if "logits" not in entry:
            return (entry["token"], entry["q"], 1) if rank == 1 and entry["token"] is not None else (None, None, rank)
        if entry["q"] is not None:  # sampled: an independent draw (duplicates are allowed and correct)
            return int(sample(entry["q"], self.generator)), entry["q"], rank
        if entry["order"] is None:
            entry["order"] = torch.topk(entry["logits"], min(16, entry["logits"].shape[-1])).indices.tolist()
        order = entry["order"]
        while rank <= len(order) and order[rank - 1] in taken:
            rank += 1
        if rank > len(order):
            return None, None, rank
        return order[rank - 1], None, rank

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        nodes: list[_Node] = []
        entries: dict[tuple[int, int], dict] = {}  # (node, drafter) -> proposal (node -1 = root)
        next_rank: dict[tuple[int, int], int] = {}
        taken: dict[int, set[int]] = {}  # deterministic child tokens per node

        def add(node: int, i: int, rank: int) -> bool:
            path = path_to(node, [n.parent for n in nodes])
            ctx = context + [nodes[j].token for j in path]
            key = (node, i)
            if key not in entries:
                entries[key] = self._scores(i, ctx)
            token, q, rank = self._child(entries[key], i, next_rank.get(key, rank), taken.setdefault(node, set()))
            next_rank[key] = rank + 1
            if token is None:
                next_rank[key] = 1 << 30  # exhausted
                return False
            depth = 1 if node < 0 else nodes[node].depth + 1
            reach = 1.0 if node < 0 else nodes[node].reach
            prev = 1.0
            for r in range(1, rank):
                prev *= 1 - self._alpha(i, depth, r)
            nodes.append(_Node(token, node, depth, i, rank, q, reach * prev * self._alpha(i, depth, rank)))
            if q is None:
                taken[node].add(token)
            return True

        if isinstance(self.policy, StaticTreePolicy):
            frontier = [-1]
            for depth, width in enumerate(self.policy.widths[:budget], start=1):
                new = []
                for node in frontier:
                    for _ in range(width):
                        if add(node, 0, next_rank.get((node, 0), 1)):
                            new.append(len(nodes) - 1)
                frontier = new
        else:
            self._grow_dynamic(nodes, add, next_rank, budget)

        tokens = torch.tensor([n.token for n in nodes], dtype=torch.long)
        parents = [n.parent for n in nodes]
        q = None
        if any(n.q is not None for n in nodes):
            ref = next(n.q for n in nodes if n.q is not None)
            rows = [n.q if n.q is not None else torch.nn.functional.one_hot(torch.tensor(n.token), ref.shape[-1]).to(ref) for n in nodes]
            q = torch.stack(rows)  # [n, V]
        self._last = nodes
        fit = self.vcost.fit()
        stats = TreeStats(
            node_drafters=[self.names[n.drafter] for n in nodes],
            expected_accepted=round(sum(n.reach for n in nodes), 4),
            estimates={
                "alpha": self.alpha.snapshot(),
                "drafter_cost_s": {k: round(v, 6) for k, v in self.dcost.seconds.items()},
                "verify_fit_s": None if fit is None else [round(fit[0], 6), round(fit[1], 6)],
            },
        )
        return DraftBlock(tokens, q, self.name, parents=parents, tree=stats)

    def _grow_dynamic(self, nodes: list[_Node], add, next_rank: dict, budget: int) -> None:
        pol = self.policy
        max_depth = min(pol.max_depth, budget)
        while len(nodes) < pol.max_nodes:
            dc, slope = self._costs()
            best, best_ratio = None, pol.t_min
            for node in [-1] + list(range(len(nodes))):
                depth = 1 if node < 0 else nodes[node].depth + 1
                if depth > max_depth:
                    continue
                reach = 1.0 if node < 0 else nodes[node].reach
                for i, d in enumerate(self.drafters):
                    rank = next_rank.get((node, i), 1)
                    limit = pol.max_rank if isinstance(d, LMDrafter) else 1
                    if rank > limit:
                        continue
                    value = reach * self._alpha(i, depth, rank)
                    for r in range(1, rank):
                        value *= 1 - self._alpha(i, depth, r)
                    cost = slope + (0.0 if (node, i) in next_rank else dc[i])
                    ratio = value / max(cost, 1e-9)
                    if ratio > best_ratio:
                        best, best_ratio = (node, i, rank), ratio
            if best is None:
                return
            add(*best)

    def observe(self, context: list[int], result: VerifyResult, verify_time_s: float | None = None,
                hidden: torch.Tensor | None = None) -> None:
        """Update α̂ from the judged nodes and Δverify from the forward's time."""
        nodes = self._last
        for node, verdict in zip(nodes, result.judgements):
            if verdict in (ACCEPTED, REJECTED):
                key = f"depth{node.depth}" if node.rank == 1 else f"rank{node.rank}"
                self.alpha.update(self.names[node.drafter], key, verdict == ACCEPTED)
        if verify_time_s is not None:
            self.vcost.update(len(nodes) + 1, verify_time_s)
        for d in self.drafters:
            d.observe(context, result, verify_time_s, hidden if d.hidden_layer is not None else None)
        self._last = []
