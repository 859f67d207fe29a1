"""CAS-Spec's Dynamic Tree Cascade (DyTC), priced per level.

The tree grows one depth at a time. At each depth the policy decides which frontier nodes each
drafter expands and how many children each gets, by expected accepted tokens per unit of cost,
in target-step units:

    step so far      gain  = 1 + sum reach(node)       cost = 1 + drafter calls + Δverify * nodes
    expand node x    gain += reach(x) * α̂_d            cost += ĉ(w) - ĉ(w - 1) + Δverify
    add a child      gain += reach(x) * α̂(child)       cost += Δverify

and takes an expansion while its gain / cost >= max(t_min, the step's gain / cost so far): the
seed's rule (stop a branch when α̂ / ĉ * prod α̂ < t_min) with the threshold raised to the step's
own expected tokens per cost, so an expansion must improve the expected throughput of the step.
The empty tree (plain decoding, 1 / 1) and the chain of one drafter are in this space: when
drafting does not pay the policy stops drafting (every ``explore``-th step still drafts one level,
so the estimates stay current).

Pricing (:class:`CallPrices`): every price comes from a ``cascade.costs.CostModel``, read in
target steps (divided by a one-input target forward): ĉ(w), an LM drafter's forward over w nodes;
Δverify(m), the growth of the verification forward when a tree of m nodes gets one more
(t(m + 2) - t(m + 1): the root is an input too), priced at the slope where the recent trees end
(every node shares one verification) or at its own position when past it; a forward-free
drafter's proposal. The model is this run's timings (``MeasuredCosts``: medians over a window
per size, monotone and convex, with standard errors) or, with ``device``, a named device's
roofline (``RooflineCosts``: deterministic; on a virtual clock, the clock's own prices). α̂
(``NodeAcceptance``): a deterministic child's from its confidence bucket, a sampled child's from
its depth and sibling rank, decided before it is drawn.

The guarantee (``cascade.trees.guard``): each grown tree is verified only when its expected
tokens per cost beat the best chain it contains by more than the cost model's uncertainty
(else that chain is verified), and a realised-outcome check drafts chains while trees deliver
fewer tokens per second than chains did, by more than the noise of its window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from cascade.costs import CostModel, Device, ForwardShape, MeasuredCosts, RooflineCosts, decode_clock, device_named
from cascade.models.lm import CausalLM
from cascade.trees.growth import LevelCalls, Tree
from cascade.trees.guard import RealisedCheck, Valued, best_chain, keep_tree
from cascade.trees.policy import TreePolicy
from cascade.types import PolicyEstimates


class CallPrices:
    """What drafter calls and verification cost, in target steps, from the policy's cost model
    (``cascade.costs``: this run's robust timings, or a named device's roofline)."""

    def __init__(self, names: list[str], policy: "DynamicTreePolicy") -> None:
        self.names, self.policy = names, policy
        self.costs: CostModel = MeasuredCosts()
        self.tree_nodes = 0.0  # EMA of the verified trees' node counts (0: none yet)

    def use_roofline(self, target: CausalLM, calls: LevelCalls, device: str | Device) -> None:
        """Price from ``device``'s roofline: the target's and each LM drafter's forward shapes."""
        shapes = {self.names[i]: calls.drafters[i].forward_shape() for i in range(len(self.names)) if calls.is_lm(i)}
        self.costs = RooflineCosts(device, ForwardShape.of(target), shapes)

    def record(self, tree: Tree, seen: int) -> None:
        """Take the tree's drafter-call timings from index ``seen`` on."""
        for t in tree.timings[seen:]:
            if t.width:
                self.costs.observe_forward(self.names[t.drafter], t.width, t.seconds)
            else:
                self.costs.observe_lookup(self.names[t.drafter], t.seconds)

    def calibrate(self, target: CausalLM) -> None:
        """Time target forwards of a few sizes on a scratch cache (fits Δverify before decoding)."""
        cache = target.new_cache()
        target.forward([0] * 64, cache)
        for n in (1, 2, 4, 6, 8, 12, 16, 24, 32):
            for _ in range(3):  # three samples each: the curve takes their median
                t0 = time.perf_counter()
                target.forward([0] * n, cache)
                self.costs.observe_verify(n, time.perf_counter() - t0)
                target.crop(cache, 64)

    def record_tree(self, nodes: int, decay: float = 0.8) -> None:
        self.tree_nodes = float(nodes) if not self.tree_nodes else decay * self.tree_nodes + (1 - decay) * nodes

    def target_step(self) -> float | None:
        """Seconds of a one-input target forward (one autoregressive step), when known."""
        if not self.policy.measure_costs:
            return None  # every price then comes from the policy's priors
        step = self.costs.verify(1)
        return step.seconds if step is not None and step.seconds > 0 else None

    def _verify_unit(self) -> float | None:
        """The target step verification prices are divided by, once two sizes are measured (or
        the prices are a device's); None: price by the prior slope."""
        step = self.target_step()
        return step if step is not None and (self.costs.predicts or self.costs.verify_sizes() >= 2) else None

    def verify_per_node(self, nodes: float) -> float:
        """Δverify(nodes): what one more node costs a verification of ``nodes`` nodes (nodes + 1
        inputs with the root), in target steps; the prior slope until two sizes are measured."""
        step = self._verify_unit()
        if step is None:
            return self.policy.prior_verify_slope
        return (self.costs.verify(nodes + 2).seconds - self.costs.verify(nodes + 1).seconds) / step

    def verify_nodes(self, nodes: int) -> tuple[float, float]:
        """(cost, standard error) of verifying ``nodes`` nodes, in target steps."""
        step = self._verify_unit()
        if step is None:
            return 1.0 + self.policy.prior_verify_slope * nodes, 0.0
        price = self.costs.verify(nodes + 1)
        return price.seconds / step, price.sd / step

    def forward(self, i: int, width: int) -> float:
        """ĉ(width): LM drafter i's forward over ``width`` nodes (0 for width 0); proportional to
        the width until it is measured."""
        if width <= 0:
            return 0.0
        step = self.target_step()
        price = None if step is None else self.costs.forward(self.names[i], width)
        return self.policy.prior_drafter_cost * width if price is None else price.seconds / step

    def lookup(self, i: int) -> float:
        step = self.target_step()
        price = None if step is None else self.costs.lookup(self.names[i])
        return self.policy.prior_lookup_cost if price is None else price.seconds / step

    def drafting(self, tree: Tree) -> float:
        """The drafting a tree cost, priced (target steps)."""
        return sum(self.forward(t.drafter, t.width) if t.width else self.lookup(t.drafter) for t in tree.timings)

    def snapshot(self) -> dict:
        """Seconds (``PolicyEstimates``' cost fields): forward-free proposals, LM drafters'
        forwards by width, the target's by input count."""
        return self.costs.snapshot()


@dataclass
class _StepValue:
    """Expected tokens and cost of the step so far, in target steps; and the same for its spine
    (first children only, every drafter call included)."""

    gain: float = 1.0
    cost: float = 1.0
    spine_gain: float = 1.0
    spine_cost: float = 1.0

    @property
    def rate(self) -> float:
        return self.gain / self.cost

    def count(self, gain: float, per_node: float, first: bool = True) -> None:
        """A node added: its expected tokens and its Δverify (``first``: a first child)."""
        self.gain, self.cost = self.gain + gain, self.cost + per_node
        if first:
            self.spine_gain, self.spine_cost = self.spine_gain + gain, self.spine_cost + per_node

    def call(self, cost: float) -> None:
        """A drafter call made."""
        self.cost += cost
        self.spine_cost += cost


@dataclass
class _Turn:
    """One drafter's turn at one depth of the tree a step grows."""

    tree: Tree
    calls: LevelCalls
    drafter: int  # index into calls.drafters
    depth: int
    step: _StepValue  # the step so far, updated as nodes are added
    must_try: bool  # an exploring step: try one node even when it does not pay
    chain: bool = False  # chain mode: at most one node per depth (first children only)


@dataclass
class DynamicTreePolicy(TreePolicy):
    t_min: float = 0.7  # never expand below this many expected tokens per target-step of cost
    max_nodes: int = 32
    max_depth: int = 10
    max_rank: int = 4  # most children one LM drafter may add to one node
    prior_drafter_cost: float = 0.2  # an LM drafter's one-node forward before it is measured, in target steps
    prior_lookup_cost: float = 0.01  # a forward-free drafter's proposal before it is measured
    prior_verify_slope: float = 0.02  # Δverify per node before two forward sizes are measured, in target steps
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of every depth / rank α̂
    depth_prior: str = "above"  # depth d's α̂ prior centred on depth d - 1's ("flat": the Beta prior at every depth)
    price_at_tree_size: bool = True  # Δverify of a node at max(its position, the recent trees' mean size) (False: its position)
    siblings_apart: bool = True  # ranked siblings' confidence buckets apart from first children's (False: one record, for comparison)
    explore: int = 16  # every explore-th step drafts one level even when it does not pay (0: never)
    measure_costs: bool = True  # False: price with the priors only (deterministic shapes, e.g. tiny test models)
    calibrate: bool = False  # time target forwards of 1..32 inputs once, before decoding (fits Δverify)
    device: str | Device | None = None  # price from this device's roofline (a cascade.costs.DEVICES name); None: this run's timings
    guard: bool = True  # verify a tree only when it beats the best chain it contains (cascade.trees.guard)
    margin: float = 1.0  # ... by more than this many standard errors of the cost model
    min_gain: float = 0.02  # ... and by at least this fraction of the chain's expected tokens per cost
    realised_window: int = 32  # steps per mode in the realised-outcome check (0: off, always trees)
    probe: int = 16  # the realised-outcome check drafts the other mode every probe-th step
    realised_margin: float = 2.0  # ... and drafts chains when trees deliver fewer tokens/s by more than this many standard errors
    depth_rate: str = "step"  # a node to expand must beat the step's rate ("spine": its first children's, siblings left out)
    # chain mode's rule: None, the priced rule above with one node per depth; a probability: an LM
    # drafter's greedy chain while each token is at least this likely, at most chain_k deep (the
    # chain LMDrafter(k=chain_k, stop_below=chain_stop_below) drafts), so the chain DyTC falls back
    # to is that chain itself, not an estimate of it
    chain_stop_below: float | None = None
    chain_k: int = 8
    chain_drafter: int = 0  # which drafter (its index) drafts the named chain
    kind = "dytc"
    steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.t_min < 0 or self.max_nodes < 1 or self.max_depth < 1 or self.max_rank < 1 or self.explore < 0:
            raise ValueError(f"invalid dynamic tree policy {self}")
        if self.depth_rate not in ("step", "spine"):
            raise ValueError(f"depth_rate must be 'step' or 'spine', got {self.depth_rate!r}")
        if self.chain_stop_below is not None and not 0.0 <= self.chain_stop_below <= 1.0 or self.chain_k < 1:
            raise ValueError(f"chain_stop_below must lie in [0, 1] and chain_k >= 1, got {self.chain_stop_below}, {self.chain_k}")
        if self.margin < 0 or self.min_gain < 0 or self.realised_window < 0 or not self.realised_margin >= 0:
            raise ValueError(f"invalid dynamic tree policy guard {self}")
        if self.device is not None:
            device_named(self.device)  # an unknown device fails here, before any model loads
        self._calibrated = False
        self.realised = RealisedCheck(self.realised_window, self.probe, margin=self.realised_margin) if self.realised_window else None
        self.last_shape = "tree"
        self._grow_seconds = 0.0

    def setup(self, names, calls: LevelCalls) -> None:
        if self.chain_stop_below is not None and not (0 <= self.chain_drafter < len(names) and calls.is_lm(self.chain_drafter)):
            raise ValueError(f"chain_drafter={self.chain_drafter} must be the index of an LM drafter among {names}")
        super().setup(names, calls)
        self.prices = CallPrices(names, self)
        self._calls = calls

    def start(self, target: CausalLM) -> None:
        if self.device is not None and not self.prices.costs.predicts:
            self.prices.use_roofline(target, self._calls, self.device)
        if self.calibrate and not self._calibrated and not self.prices.costs.predicts:
            self.prices.calibrate(target)
            self._calibrated = True

    @property
    def budget(self) -> int:
        return self.max_nodes

    def observe(self, nodes, result, verify_time_s) -> None:
        super().observe(nodes, result, verify_time_s)
        self.prices.record_tree(len(nodes))
        if verify_time_s is not None:
            self.prices.costs.observe_verify(len(nodes) + 1, verify_time_s)
        if self.realised is not None and verify_time_s is not None:
            # the outcome on the run's clock (measured, or a virtual clock's): the whole growth,
            # the policy's own work included, and the verification; not the prices, so that it
            # also catches a cost model that is wrong
            self.realised.record(result.num_accepted + 1, self._grow_seconds + verify_time_s)

    def estimates(self) -> PolicyEstimates:
        realised = {} if self.realised is None else self.realised.snapshot()
        return replace(super().estimates(), **self.prices.snapshot(), realised=realised)

    def grow(self, tree: Tree, calls: LevelCalls, budget: int) -> list[int]:
        """1. pick the mode (the realised-outcome check); 2. grow; 3. the guard: verify the best
        contained chain unless the tree beats it (``cascade.trees.guard``)."""
        self.steps += 1
        started = decode_clock()
        self.prices.costs.set_context(len(tree.context))
        chain = self.realised is not None and self.realised.next_mode() == "chain"
        self._grow(tree, calls, budget, chain)
        self._grow_seconds = decode_clock() - started
        everything = list(range(len(tree.nodes)))
        self.last_shape = "chain" if chain else "tree"
        if chain or not self.guard or not tree.nodes or any(n.q is not None for n in tree.nodes):
            # a tree with sampled nodes is verified whole: which of its chains pays most depends on
            # the nodes below each one, which depend on the tokens drawn; keeping a sampled node
            # or not by its own value would verify a token no longer distributed as its q
            return everything
        return self._guarded(tree, everything)

    def _guarded(self, tree: Tree, everything: list[int]) -> list[int]:
        """The guard: the whole tree, or the best chain it contains when the tree does not beat it."""
        drafting = self.prices.drafting(tree)
        cost, sd = self.prices.verify_nodes(len(tree.nodes))
        whole = Valued(everything, 1.0 + sum(n.reach for n in tree.nodes), drafting + cost, sd)
        best = best_chain(tree, drafting, self.prices.verify_nodes)
        if best.nodes == everything or keep_tree(whole, best, self.margin, self.min_gain):
            return everything
        self.last_shape = "chain"
        return best.nodes

    def _grow(self, tree: Tree, calls: LevelCalls, budget: int, chain: bool) -> None:
        named = chain and self.chain_stop_below is not None
        if named and calls.deterministic(self.chain_drafter):
            self._named_chain_path(tree, calls, min(self.chain_k, budget, self.max_nodes))
            return
        exploring = self.explore > 0 and self.steps % self.explore == 0
        step = _StepValue()
        frontier = [-1]  # below: a sampled named chain is priced, one node per depth
        for depth in range(1, min(self.chain_k if named else self.max_depth, budget) + 1):
            level: list[int] = []
            for i in [self.chain_drafter] if named else self._order(depth, len(calls.drafters)):
                if len(tree.nodes) >= self.max_nodes or not frontier or (chain and level):
                    break
                turn = _Turn(tree, calls, i, depth, step, must_try=exploring and depth == 1, chain=chain)
                by_reach = sorted(frontier, key=lambda x: -tree.reach(x))
                level += self._lm_level(turn, by_reach) if calls.is_lm(i) else self._lookup_level(turn, by_reach)
            frontier = level
            if not frontier:
                break

    def _named_chain_path(self, tree: Tree, calls: LevelCalls, n: int) -> None:
        """Chain mode's named chain, drafted on the chain drafter's own chain path
        (``LevelCalls.chain``): the drafts of ``LMDrafter(k=chain_k, stop_below=chain_stop_below)``
        on the chain's own code: the chain DyTC falls back to is that chain, its cost included
        (not one-node tree levels with tree positions, masks and a pricing of every level)."""
        if n < 1:
            return
        i, seen = self.chain_drafter, len(tree.timings)
        parent = -1
        for token, conf in calls.chain(tree, i, n, self.chain_stop_below):
            reach = tree.reach(parent) * self.acceptance.confident(i, conf)
            parent = tree.add(parent, drafter=i, rank=1, token=token, q=None, reach=reach, conf=conf)
        self.prices.record(tree, seen)

    def _order(self, depth: int, drafters: int) -> list[int]:
        """The drafters by the α̂ of their first child at this depth, best first. In chain mode the
        first that adds a node takes the depth; in tree mode the most likely path is built by the
        most accepted drafter and the others add nodes only where they beat the rate it set. By
        expected tokens per cost instead, a cheap drafter accepted a third of the time (Token
        Recycling, prompt lookup) took each depth of the chains and cut them short; by the order
        listed, a costly weak draft head took nodes it did not pay for."""
        return sorted(range(drafters), key=lambda i: self.acceptance.first_child(i, depth), reverse=True)

    def _node(self, tree: Tree, ahead: int = 0) -> float:
        """Δverify of the next node when ``ahead`` more are already planned on top of the tree.

        Every node of a tree shares one verification forward, whose cost is the curve at the size
        the tree ends at: what a node adds is the curve's slope there, not at the position it came
        in. Priced by position (``price_at_tree_size=False``), the first nodes of a tree took the
        flat start of a convex curve nearly free, so level 1 filled with siblings the target
        accepted 3-10% of the time and the first children deeper down paid the steep part. So a
        node is priced at the larger of its position and the recent trees' mean size."""
        size = len(tree.nodes) + ahead
        if self.price_at_tree_size:
            size = max(size, self.prices.tree_nodes)
        return max(self.prices.verify_per_node(size), 1e-6)

    def _worth(self, gain: float, cost: float, step: _StepValue) -> bool:
        return gain / cost >= max(self.t_min, step.rate)

    def _ranks(self, turn: _Turn) -> int:
        return 1 if turn.chain else self.max_rank

    def _lookup_level(self, turn: _Turn, by_reach: list[int]) -> list[int]:
        """A forward-free drafter proposes below the most reached nodes while it pays."""
        tree, i, added = turn.tree, turn.drafter, []
        for x in by_reach:
            per_node = self._node(tree)
            gain, cost = tree.reach(x) * self.acceptance.first_child(i, turn.depth), self.prices.lookup(i) + per_node
            if len(tree.nodes) >= self.max_nodes or not (self._worth(gain, cost, turn.step) or turn.must_try):
                break
            seen = len(tree.timings)
            token, q = turn.calls.lookup(tree, i, x)
            self.prices.record(tree, seen)
            turn.step.call(self.prices.lookup(i))
            if token is not None and (q is not None or token not in tree.taken.get(x, set())):
                added.append(tree.add(x, drafter=i, rank=1, token=token, q=q, reach=gain))
                turn.step.count(gain, per_node)
                if turn.chain:
                    break
        return added

    def _lm_level(self, turn: _Turn, by_reach: list[int]) -> list[int]:
        tree, i = turn.tree, turn.drafter
        # 1. which frontier nodes to expand: one forward of width w, priced as it grows
        alpha_first = self.acceptance.first_child(i, turn.depth)
        extra = 0 if i in tree.started or turn.depth == 1 else 1  # a late start also feeds the root
        spine = self.depth_rate == "spine"
        start = (turn.step.spine_gain, turn.step.spine_cost) if spine else (turn.step.gain, turn.step.cost)
        expand, trial = [], _StepValue(*start)
        for x in by_reach[: 1 if turn.chain else self.max_nodes - len(tree.nodes)]:
            width = len(expand) + 1 + extra
            gain = tree.reach(x) * alpha_first
            per_node = self._node(tree, len(expand))  # each expanded node's first child
            cost = self.prices.forward(i, width) - self.prices.forward(i, width - 1) + per_node
            if not self._worth(gain, cost, trial) and not (turn.must_try and not expand):
                break
            expand.append(x)
            trial.gain, trial.cost = trial.gain + gain, trial.cost + cost - per_node
        if not expand:
            return []
        turn.step.call(self.prices.forward(i, len(expand) + extra))
        seen = len(tree.timings)
        logits = turn.calls.forward(tree, i, expand)
        self.prices.record(tree, seen)
        # 2. which children to add: each costs Δverify; best first across the level
        if turn.calls.deterministic(i):
            return self._ranked_children(turn, expand, logits)
        return self._sampled_children(turn, expand, logits)

    def _ranked_children(self, turn: _Turn, expand: list[int], logits) -> list[int]:
        tree, i = turn.tree, turn.drafter
        candidates = [(tree.reach(x) * self.acceptance.confident(i, conf, rank), x, rank, token, conf)
                      for x in expand
                      for rank, (token, conf) in enumerate(turn.calls.ranked(tree, x, logits[x], self._ranks(turn)), start=1)]
        candidates.sort(key=lambda c: -c[0])
        added = []
        for n, (gain, x, rank, token, conf) in enumerate(candidates):
            per_node = self._node(tree)
            wanted = self._worth(gain, per_node, turn.step) or (turn.must_try and n == 0)
            if len(tree.nodes) >= self.max_nodes or not wanted:
                break
            if token in tree.taken.get(x, set()):
                continue
            added.append(tree.add(x, drafter=i, rank=rank, token=token, q=None, reach=gain, conf=conf))
            turn.step.count(gain, per_node, first=rank == 1)
        return added

    def _sampled_children(self, turn: _Turn, expand: list[int], logits) -> list[int]:
        """Each sibling is decided before it is drawn (its inclusion must not depend on its value)."""
        tree, i, added = turn.tree, turn.drafter, []
        for n, x in enumerate(expand):
            q = turn.calls.q(logits[x])  # [V]
            for rank in range(1, self._ranks(turn) + 1):
                gain = tree.reach(x) * self.acceptance.sibling(i, turn.depth, rank)
                per_node = self._node(tree)
                first = turn.must_try and n == 0 and rank == 1
                if len(tree.nodes) >= self.max_nodes or not (self._worth(gain, per_node, turn.step) or first):
                    break
                added.append(tree.add(x, drafter=i, rank=rank, token=turn.calls.draw(q), q=q, reach=gain))
                turn.step.count(gain, per_node, first=rank == 1)
        return added
