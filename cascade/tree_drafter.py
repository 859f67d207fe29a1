"""Tree drafting, level by level: static trees, an EAGLE-2-style reranked tree, and CAS-Spec's
Dynamic Tree Cascade (DyTC) priced per level.

``TreeDrafter(drafters, policy)`` grows a token tree below the last committed token and returns
it as one ``DraftBlock`` with ``parents`` (see ``cascade.tree``); ``cascade.generate`` verifies
it in one tree-attention forward. The tree grows one depth at a time:

* an LM drafter (``LMDrafter``: small LM, quantized LM, layer skip, Kangaroo) scores **all the
  nodes it expands at a depth in one forward** (``tree_start`` for the root, then
  ``tree_level`` with tree positions and the tree mask on its own cache); a node's children are
  its rank-1, rank-2, ... tokens (greedy, or a drafter with ``sample=False``: deterministic,
  one-hot q) or independent draws from its processed ``q`` (sampled). So an LM drafter costs
  at most one forward per depth (``TreeStats.drafter_forwards``). After verification its cache
  is compacted to the accepted path (``tree_commit``);
* any other drafter (n-gram, a cascade) proposes one token for a node, without a forward.

Policies:

``StaticTreePolicy(widths)``
    every node at depth d - 1 gets ``widths[d - 1]`` children from the first drafter
    (``widths=[1] * k`` is a chain).
``RerankedTreePolicy(top_k, depth, max_nodes)`` (EAGLE-2)
    expand the ``top_k`` nodes of the newest level with the highest global score (the product
    of the drafter's probabilities along the path), ``top_k`` ranked children each, for
    ``depth`` levels; then verify only the ``max_nodes`` nodes with the highest score (a set
    closed under ancestors: a score never grows down a path). Children are always ranked
    (deterministic): choosing sampled siblings by their own scores would bias them.
``DynamicTreePolicy(t_min, max_nodes, ...)`` (DyTC, priced per level)
    decides, level by level, which frontier nodes each drafter expands and how many children
    each gets, by expected accepted tokens per unit of cost, in target-step units:

        step so far      E = 1 + sum reach(node),   T = 1 + drafter forwards + Δverify * nodes
        expand node x    value = reach(x) * α̂_d      cost = ĉ(w) - ĉ(w - 1) + Δverify
        add child        value = reach(x) * α̂(child) cost = Δverify

    and takes an expansion while value / cost >= max(t_min, E / T): the seed's rule (stop a
    branch when α̂ / ĉ * prod α̂ < t_min) with the threshold raised to the step's own expected
    tokens per cost, so an expansion must improve the expected throughput of the step. The
    empty tree (plain decoding, E / T = 1) and the chain of one drafter are in this space: when
    drafting does not pay the policy stops drafting (every ``explore``-th step still drafts one
    level, so the estimates stay current). ĉ(w) is the drafter's forward time at width w,
    fitted online (a + b w, linear in w until two widths are seen); Δverify the fitted growth
    of verification time per node; α̂_d the drafter's acceptance at depth d. A deterministic
    child's α̂ is read from its confidence (the drafter's probability of the token, in
    buckets, calibrated online: for ranked children the events "target's argmax is this
    token" are disjoint, so values add); a sampled child's from its depth and sibling rank,
    decided before it is drawn (its inclusion must not depend on its own value).

Estimates (``cascade.estimators``) are updated from every verification (the judged nodes and the
verification forward's time, both handed to ``observe``) and logged per step in the block's
``TreeStats``. Each LM drafter's catch-up on the prompt happens in ``prefill``, outside the
tree, so no drafter cost estimate ever includes it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from cascade.drafters.base import Drafter, shared_hidden_layer
from cascade.drafters.lm_base import LMDrafter
from cascade.estimators import AcceptanceTable, DrafterCost, VerifyCost
from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.tree import path_to
from cascade.types import ACCEPTED, REJECTED, DraftBlock, DrafterInfo, SamplingConfig, Scored, TreeStats, VerifyResult

# confidence buckets of a deterministic child (the drafter's probability of its token)
CONF_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)
_CONF_MIDS = (0.025, 0.1, 0.225, 0.4, 0.6, 0.775, 0.9, 0.975)


def conf_bucket(conf: float) -> int:
    return bisect.bisect_right(CONF_EDGES, conf)


@dataclass
class StaticTreePolicy:
    widths: tuple[int, ...] = (2, 2, 1, 1)

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"static tree widths must be positive, got {self.widths}")


@dataclass
class RerankedTreePolicy:
    top_k: int = 4  # nodes expanded per level, and children per expanded node
    depth: int = 5  # levels grown
    max_nodes: int = 16  # nodes verified (the highest global scores)

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or self.max_nodes < 1:
            raise ValueError(f"invalid reranked tree policy {self}")


@dataclass
class DynamicTreePolicy:
    t_min: float = 0.7  # never expand below this many expected tokens per target-step of cost
    max_nodes: int = 32
    max_depth: int = 10
    max_rank: int = 4  # most children one LM drafter may add to one node
    prior_drafter_cost: float = 0.2  # an LM drafter's one-node forward before it is measured, in target steps
    prior_lookup_cost: float = 0.01  # a forward-free drafter's proposal before it is measured
    prior_verify_slope: float = 0.02  # Δverify per node before it is fitted, in target steps
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of every depth / rank α̂
    explore: int = 16  # every explore-th step drafts one level even when it does not pay (0: never)
    measure_costs: bool = True  # False: price with the priors only (deterministic shapes, e.g. tiny test models)

    def __post_init__(self) -> None:
        if self.t_min < 0 or self.max_nodes < 1 or self.max_depth < 1 or self.max_rank < 1 or self.explore < 0:
            raise ValueError(f"invalid dynamic tree policy {self}")


TreePolicy = StaticTreePolicy | RerankedTreePolicy | DynamicTreePolicy


@dataclass
class _Node:
    token: int
    parent: int  # node index, -1 = root
    depth: int
    drafter: int  # index into TreeDrafter.drafters
    rank: int  # 1 = the drafter's first child of this parent
    q: torch.Tensor | None  # [V] the distribution it was drawn from (sampled); None: deterministic
    reach: float  # the policy's estimate that the path to this node is accepted
    conf: float | None = None  # deterministic LM child: the drafter's probability of the token
    score: float = 1.0  # product of conf along the path (the reranked tree's global score)


class _Growth:
    """One tree being grown: its nodes and which LM drafters have started on it."""

    def __init__(self, context: list[int]) -> None:
        self.context = context
        self.nodes: list[_Node] = []
        self.started: set[int] = set()  # LM drafters that ran tree_start
        self.taken: dict[int, set[int]] = {}  # deterministic child tokens per node (-1 = root)
        self.forwards = 0  # LM drafter forwards

    def reach(self, node: int) -> float:
        return 1.0 if node < 0 else self.nodes[node].reach

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.nodes[node].depth

    def path_tokens(self, node: int) -> list[int]:
        return [self.nodes[j].token for j in path_to(node, [n.parent for n in self.nodes])]

    def add(self, node: _Node) -> int:
        self.nodes.append(node)
        if node.q is None:
            self.taken.setdefault(node.parent, set()).add(node.token)
        return len(self.nodes) - 1


class TreeDrafter(Drafter):
    def __init__(self, drafters: list[Drafter], policy: TreePolicy | None = None,
                 calibrate: bool = False, name: str | None = None) -> None:
        self.drafters = list(drafters)
        if not self.drafters:
            raise ValueError("a tree drafter needs at least one drafter")
        self.policy = policy or DynamicTreePolicy()
        if isinstance(self.policy, (StaticTreePolicy, RerankedTreePolicy)) and not isinstance(self.drafters[0], LMDrafter):
            raise TypeError("a static or reranked tree's first drafter must be an LM drafter (it provides ranked children)")
        self.calibrate = calibrate
        self.names = [f"{i}:{d.name}" for i, d in enumerate(self.drafters)]
        self.name = name or f"{self._short()}_tree({', '.join(d.name for d in self.drafters)})"
        prior = getattr(self.policy, "prior", (1.0, 1.0))
        self.alpha = AcceptanceTable(prior=tuple(prior))
        self.dcost = DrafterCost()  # forward-free drafters: seconds per proposal
        self.fcost = {n: VerifyCost() for n in self.names}  # LM drafters: seconds per forward of width w
        self.vcost = VerifyCost()
        self._calibrated = False
        self._steps = 0
        self._last: list[_Node] = []  # the verified nodes of the last proposal
        self._last_ids: list[int] = []  # their ids in that proposal's growth (what the drafters fed)
        self._started: set[int] = set()
        self.hidden_layer = shared_hidden_layer(self.drafters, "tree drafters")

    def _short(self) -> str:
        return {StaticTreePolicy: "static", RerankedTreePolicy: "reranked", DynamicTreePolicy: "dytc"}[type(self.policy)]

    @property
    def kind(self) -> str:
        return f"{self._short()}_tree"

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
        self._last, self._last_ids, self._started = [], [], set()
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

    def _conf_alpha(self, drafter: int, conf: float) -> float:
        """α̂ of a deterministic child whose drafter probability is ``conf`` (calibrated by bucket;
        the prior is a calibrated drafter, worth two observations)."""
        b = conf_bucket(conf)
        return self.alpha.mean(self.names[drafter], f"conf{b}", prior=(2 * _CONF_MIDS[b], 2 * (1 - _CONF_MIDS[b])))

    def _unit(self) -> float | None:
        """Seconds of a one-input target forward (one autoregressive step), when measured."""
        if not getattr(self.policy, "measure_costs", True):
            return None  # every cost then comes from the policy's priors
        u = self.vcost.predict(1)
        return u if u is not None and u > 0 else None

    def _verify_slope(self) -> float:
        """Δverify: growth of the verification forward per tree node, in target steps."""
        unit, fit = self._unit(), self.vcost.fit()
        if unit is None or fit is None or len({n for n, _ in self.vcost.obs}) < 2:
            return self.policy.prior_verify_slope
        return fit[1] / unit

    def _forward_cost(self, i: int, width: int) -> float:
        """ĉ(width): drafter i's forward over ``width`` nodes, in target steps (0 for width 0)."""
        if width <= 0:
            return 0.0
        unit, cost = self._unit(), self.fcost[self.names[i]]
        if unit is None or not cost.obs:
            return self.policy.prior_drafter_cost * width
        a, b = cost.fit()
        if len({n for n, _ in cost.obs}) < 2:  # one width seen: assume linear growth until another is
            one = cost.predict(1) if b > 0 else a
            return one * width / unit
        return (a + b * width) / unit

    def _lookup_cost(self, i: int) -> float:
        unit, s = self._unit(), self.dcost.get(self.names[i])
        return self.policy.prior_lookup_cost if unit is None or s is None else s / unit

    # ---- drafter calls ----------------------------------------------------------------------
    def _lm_forward(self, g: _Growth, i: int, expand: list[int]) -> dict[int, torch.Tensor]:
        """Drafter i's next-token logits [V] at every node of ``expand`` (-1 = root), in one
        forward per call (plus ``tree_start`` if drafter i has not started on this tree)."""
        d: LMDrafter = self.drafters[i]
        out: dict[int, torch.Tensor] = {}
        if i not in g.started:  # the root's logits come with the start
            t0 = time.perf_counter()
            out[-1] = d.tree_start(g.context)
            self.fcost[self.names[i]].update(1, time.perf_counter() - t0)
            g.started.add(i)
            g.forwards += 1
        todo = [x for x in expand if x >= 0]
        if not todo:
            return out
        feed: list[int] = []  # the nodes and any ancestors this drafter has not seen, parents first
        for x in todo:
            for j in path_to(x, [n.parent for n in g.nodes]):
                if not d.tree_fed(j) and j not in feed:
                    feed.append(j)
        feed.sort(key=lambda j: (g.nodes[j].depth, j))
        t0 = time.perf_counter()
        rows = d.tree_level(feed, [g.nodes[j].token for j in feed], [g.nodes[j].parent for j in feed])  # [w, V]
        self.fcost[self.names[i]].update(len(feed), time.perf_counter() - t0)
        g.forwards += 1
        for r, j in enumerate(feed):
            out[j] = rows[r]
        return {x: out[x] for x in expand}

    def _lookup(self, g: _Growth, i: int, node: int) -> tuple[int | None, torch.Tensor | None]:
        """A forward-free drafter's one proposal below ``node``."""
        t0 = time.perf_counter()
        block = self.drafters[i].propose(g.context + g.path_tokens(node), 1)
        self.dcost.update(self.names[i], time.perf_counter() - t0)
        if not block.k:
            return None, None
        return int(block.tokens[0]), None if block.q is None else block.q[0]

    def _deterministic(self, i: int) -> bool:
        return self.sampling.greedy or not getattr(self.drafters[i], "sample", True)

    def _ranked(self, g: _Growth, node: int, logits: torch.Tensor, count: int) -> list[tuple[int, float]]:
        """Up to ``count`` (token, drafter probability) of the highest-ranked tokens at ``node``
        that are not already a deterministic child of it."""
        probs = torch.softmax(logits.float(), -1)  # [V]
        taken = g.taken.get(node, set())
        top = torch.topk(probs, min(count + len(taken), probs.shape[-1]))
        out = [(int(t), float(p)) for p, t in zip(top.values, top.indices) if int(t) not in taken]
        return out[:count]

    def _node(self, g: _Growth, parent: int, i: int, rank: int, token: int, q, reach: float, conf: float | None = None) -> int:
        score = (1.0 if parent < 0 else g.nodes[parent].score) * (1.0 if conf is None else conf)
        return g.add(_Node(token, parent, g.depth(parent) + 1, i, rank, q, reach, conf, score))

    # ---- growing the tree -------------------------------------------------------------------
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        g = _Growth(context)
        self._steps += 1
        try:
            if isinstance(self.policy, StaticTreePolicy):
                self._grow_static(g, budget)
                keep = list(range(len(g.nodes)))
            elif isinstance(self.policy, RerankedTreePolicy):
                keep = self._grow_reranked(g, budget)
            else:
                self._grow_dynamic(g, budget)
                keep = list(range(len(g.nodes)))
        finally:
            for i in g.started:
                self.drafters[i].tree_end()
        self._started = set(g.started)
        return self._block(g, keep)

    def _block(self, g: _Growth, keep: list[int]) -> DraftBlock:
        """The verified tree: the grown nodes ``keep`` (closed under ancestors, increasing)."""
        index = {j: b for b, j in enumerate(keep)}
        nodes = [g.nodes[j] for j in keep]
        self._last = nodes
        self._last_ids = keep
        parents = [-1 if n.parent < 0 else index[n.parent] for n in nodes]
        tokens = torch.tensor([n.token for n in nodes], dtype=torch.long)
        q = None
        if any(n.q is not None for n in nodes):
            ref = next(n.q for n in nodes if n.q is not None)
            rows = [n.q if n.q is not None else torch.nn.functional.one_hot(torch.tensor(n.token), ref.shape[-1]).to(ref) for n in nodes]
            q = torch.stack(rows)  # [n, V]
        fit = self.vcost.fit()
        stats = TreeStats(
            node_drafters=[self.names[n.drafter] for n in nodes],
            expected_accepted=round(sum(n.reach for n in nodes), 4),
            drafter_forwards=g.forwards,
            estimates={
                "alpha": self.alpha.snapshot(),
                "drafter_cost_s": {k: round(v, 6) for k, v in self.dcost.seconds.items()},
                "forward_fit_s": {k: [round(x, 6) for x in c.fit()] for k, c in self.fcost.items() if c.obs},
                "verify_fit_s": None if fit is None else [round(fit[0], 6), round(fit[1], 6)],
            },
        )
        return DraftBlock(tokens, q, self.name, parents=parents, tree=stats)

    def _children(self, g: _Growth, i: int, node: int, logits: torch.Tensor, count: int) -> list[int]:
        """Add ``count`` children of ``node`` from LM drafter i's ``logits`` (ranked, or independent
        draws when sampling); reach from the depth / rank estimates."""
        depth, added = g.depth(node) + 1, []
        if self._deterministic(i):
            ranked = self._ranked(g, node, logits, count)
            for rank, (token, conf) in enumerate(ranked, start=1):
                added.append(self._node(g, node, i, rank, token, None, g.reach(node) * self._conf_alpha(i, conf), conf))
            return added
        q = logits_to_probs(logits, self.sampling)  # [V]
        for rank in range(1, count + 1):
            added.append(self._node(g, node, i, rank, int(sample(q, self.generator)), q, g.reach(node) * self._sibling_value(i, depth, rank)))
        return added

    def _sibling_value(self, i: int, depth: int, rank: int) -> float:
        """P(the rank-th sampled child is accepted | its parent is reached), from estimates only."""
        value = self._alpha(i, depth, rank)
        for r in range(1, rank):
            value *= 1 - self._alpha(i, depth, r)
        return value

    def _grow_static(self, g: _Growth, budget: int) -> None:
        frontier = [-1]
        for width in self.policy.widths[:budget]:
            if not frontier:
                return
            logits = self._lm_forward(g, 0, frontier)
            frontier = [c for x in frontier for c in self._children(g, 0, x, logits[x], width)]

    def _grow_reranked(self, g: _Growth, budget: int) -> list[int]:
        pol = self.policy
        frontier = [-1]
        for _ in range(min(pol.depth, budget)):
            logits = self._lm_forward(g, 0, frontier)
            new = []
            for x in frontier:
                for rank, (token, conf) in enumerate(self._ranked(g, x, logits[x], pol.top_k), start=1):
                    new.append(self._node(g, x, 0, rank, token, None, 0.0, conf))
            for j in new:
                g.nodes[j].reach = g.nodes[j].score  # the drafter's own estimate of the path's acceptance
            frontier = sorted(new, key=lambda j: -g.nodes[j].score)[: pol.top_k]
        best = sorted(range(len(g.nodes)), key=lambda j: (-g.nodes[j].score, g.nodes[j].depth, j))[: pol.max_nodes]
        return sorted(best)

    def _grow_dynamic(self, g: _Growth, budget: int) -> None:
        pol = self.policy
        slope = max(self._verify_slope(), 1e-6)
        explore = pol.explore > 0 and self._steps % pol.explore == 0
        E, T = 1.0, 1.0  # expected tokens and cost of the step so far, in target steps
        frontier = [-1]
        for depth in range(1, min(pol.max_depth, budget) + 1):
            new: list[int] = []
            for i, d in enumerate(self.drafters):
                room = pol.max_nodes - len(g.nodes)
                if room <= 0 or not frontier:
                    break
                trying = explore and depth == 1
                cand = sorted(frontier, key=lambda x: -g.reach(x))
                if not isinstance(d, LMDrafter):
                    for x in cand:
                        value, cost = g.reach(x) * self._alpha(i, depth, 1), self._lookup_cost(i) + slope
                        if len(g.nodes) >= pol.max_nodes or (value / cost < max(pol.t_min, E / T) and not trying):
                            break
                        token, q = self._lookup(g, i, x)
                        T += self._lookup_cost(i)
                        if token is not None and (q is not None or token not in g.taken.get(x, set())):
                            new.append(self._node(g, x, i, 1, token, q, value))
                            E, T = E + value, T + slope
                    continue
                # 1. which frontier nodes to expand: one forward of width w, priced as it grows
                a1, expand, e, t = self._alpha(i, depth, 1), [], E, T
                started = i in g.started
                for x in cand[:room]:
                    w = len(expand) + 1 + (0 if started or depth == 1 else 1)
                    dv = g.reach(x) * a1
                    dc = self._forward_cost(i, w) - self._forward_cost(i, w - 1) + slope
                    if dv / dc < max(pol.t_min, e / t) and not (trying and not expand):
                        break
                    expand.append(x)
                    e, t = e + dv, t + dc - slope
                if not expand:
                    continue
                T += self._forward_cost(i, len(expand) + (0 if started or depth == 1 else 1))
                logits = self._lm_forward(g, i, expand)
                # 2. which children to add: each costs Δverify; best first across the level
                if self._deterministic(i):
                    cands = [(g.reach(x) * self._conf_alpha(i, conf), x, r, tok, conf)
                             for x in expand for r, (tok, conf) in enumerate(self._ranked(g, x, logits[x], pol.max_rank), start=1)]
                    cands.sort(key=lambda c: -c[0])
                    for n, (value, x, r, tok, conf) in enumerate(cands):
                        if len(g.nodes) >= pol.max_nodes or (value / slope < max(pol.t_min, E / T) and not (trying and n == 0)):
                            break
                        if tok in g.taken.get(x, set()):
                            continue
                        new.append(self._node(g, x, i, r, tok, None, value, conf))
                        E, T = E + value, T + slope
                else:  # sampled: decide each sibling before drawing it
                    for n, x in enumerate(expand):
                        q = logits_to_probs(logits[x], self.sampling)  # [V]
                        for r in range(1, pol.max_rank + 1):
                            value = g.reach(x) * self._sibling_value(i, depth, r)
                            if len(g.nodes) >= pol.max_nodes or (value / slope < max(pol.t_min, E / T) and not (trying and n == 0 and r == 1)):
                                break
                            new.append(self._node(g, x, i, r, int(sample(q, self.generator)), q, value))
                            E, T = E + value, T + slope
            frontier = new
            if not frontier:
                return

    # ---- learning -----------------------------------------------------------------------------
    def observe(self, context: list[int], result: VerifyResult, verify_time_s: float | None = None,
                hidden: torch.Tensor | None = None, scored: Scored | None = None) -> None:
        """Update α̂ from the judged nodes and Δverify from the forward's time; compact each LM
        drafter's cache to the accepted path."""
        nodes = self._last
        for node, verdict in zip(nodes, result.judgements):
            if verdict not in (ACCEPTED, REJECTED):
                continue
            name, ok = self.names[node.drafter], verdict == ACCEPTED
            if node.rank == 1:
                self.alpha.update(name, f"depth{node.depth}", ok)
            elif node.q is not None:
                self.alpha.update(name, f"rank{node.rank}", ok)
            if node.conf is not None:
                b = conf_bucket(node.conf)
                self.alpha.update(name, f"conf{b}", ok, prior=(2 * _CONF_MIDS[b], 2 * (1 - _CONF_MIDS[b])))
        if verify_time_s is not None:
            self.vcost.update(len(nodes) + 1, verify_time_s)
        path = [self._last_ids[b] for b in result.path] if nodes else []
        for i in self._started:
            self.drafters[i].tree_commit(path)
        for d in self.drafters:
            d.observe(context, result, verify_time_s, hidden if d.hidden_layer is not None else None, scored)
        self._last, self._started = [], set()
