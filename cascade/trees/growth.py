"""A token tree while it is grown, and the drafter calls a tree policy grows it with.

``Tree`` holds the nodes grown so far below the last committed token (``parent`` -1 is that
token), which LM drafters have started on it, the deterministic children already taken per node
(so ranked siblings never repeat a token) and the timings of every drafter call (which a policy
that prices calls learns from). ``LevelCalls`` is what a policy may ask of the drafters:

* ``forward(tree, i, expand)``: LM drafter i's next-token logits at every node of ``expand`` in
  **one** forward (``tree_start`` first when it has not started on this tree: the root's logits
  come with it; then ``tree_level`` with tree positions and the tree mask on its own cache);
* ``chain(tree, i, n, stop_below)``: LM drafter i's greedy chain below the root on its chain
  path (``LMDrafter.chain_steps``: one-token forwards, no tree mask; the drafts and the cost of
  ``LMDrafter(k=n, stop_below=...)``), the drafter not started on the tree;
* ``lookup(tree, i, node)``: a forward-free drafter's (n-gram, Token Recycling, suffix, a
  cascade) one proposal below ``node``;
* ``ranked`` / ``sampled``: a node's children from logits: its top tokens (greedy, or a drafter
  with ``sample=False``: deterministic, one-hot q) or independent draws from its processed q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cascade.costs import charge_lookup, decode_clock
from cascade.drafters.base import Drafter
from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.stopping import ConfidenceStop
from cascade.sampling import logits_to_probs, sample
from cascade.tree_structure import path_to
from cascade.types import SamplingConfig


@dataclass
class Node:
    token: int
    parent: int  # node index, -1 = the last committed token
    depth: int
    drafter: int  # index into the tree drafter's drafters
    rank: int  # 1 = the drafter's first child of this parent
    q: torch.Tensor | None  # [V] the distribution it was drawn from (sampled); None: deterministic
    reach: float  # the policy's estimate that the path to this node is accepted
    conf: float | None = None  # deterministic LM child: the drafter's probability of the token
    score: float = 1.0  # product of conf along the path (the reranked tree's global score)


@dataclass
class CallTiming:
    drafter: int
    width: int  # nodes scored (an LM forward) or 0 (a forward-free proposal)
    seconds: float


@dataclass
class Tree:
    context: list[int]  # the committed sequence the tree grows below
    nodes: list[Node] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # LM drafters that ran tree_start on it
    taken: dict[int, set[int]] = field(default_factory=dict)  # deterministic child tokens per node (-1 = root)
    forwards: int = 0  # LM drafter forwards spent on it
    timings: list[CallTiming] = field(default_factory=list)  # every drafter call, in order

    def reach(self, node: int) -> float:
        return 1.0 if node < 0 else self.nodes[node].reach

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.nodes[node].depth

    def path_tokens(self, node: int) -> list[int]:
        return [self.nodes[j].token for j in path_to(node, [n.parent for n in self.nodes])]

    def add(self, parent: int, *, drafter: int, rank: int, token: int, q: torch.Tensor | None, reach: float,
            conf: float | None = None) -> int:
        """Append a child of ``parent`` (the fields of :class:`Node`, by name); returns its index."""
        score = (1.0 if parent < 0 else self.nodes[parent].score) * (1.0 if conf is None else conf)
        self.nodes.append(Node(token, parent, self.depth(parent) + 1, drafter, rank, q, reach, conf, score))
        if q is None:
            self.taken.setdefault(parent, set()).add(token)
        return len(self.nodes) - 1


class LevelCalls:
    """The drafters' calls, for one tree drafter's drafters and the run's sampling settings."""

    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters
        self.sampling: SamplingConfig | None = None  # the generation's, from ``start``
        self.generator: torch.Generator | None = None

    def start(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """A generation starts with these settings."""
        self.sampling, self.generator = sampling, generator

    def is_lm(self, i: int) -> bool:
        """Drafter i scores many nodes in one forward (else it proposes one token per call)."""
        return isinstance(self.drafters[i], LMDrafter)

    def deterministic(self, i: int) -> bool:
        """Drafter i's children are its ranked tokens (greedy runs, or ``sample=False``)."""
        return self.sampling.greedy or not self.drafters[i].sample

    def forward(self, tree: Tree, i: int, expand: list[int]) -> dict[int, torch.Tensor]:
        """LM drafter i's next-token logits [V] at every node of ``expand`` (-1 = root), in one
        forward per call (plus ``tree_start`` if drafter i has not started on this tree)."""
        d: LMDrafter = self.drafters[i]
        out: dict[int, torch.Tensor] = {}
        if i not in tree.started:  # the root's logits come with the start
            t0 = decode_clock()
            out[-1] = d.tree_start(tree.context)
            tree.timings.append(CallTiming(i, 1, decode_clock() - t0))
            tree.started.add(i)
            tree.forwards += 1
        todo = [x for x in expand if x >= 0]
        if not todo:
            return out
        feed: list[int] = []  # the nodes and any ancestors this drafter has not seen, parents first
        for x in todo:
            for j in path_to(x, [n.parent for n in tree.nodes]):
                if not d.tree_fed(j) and j not in feed:
                    feed.append(j)
        feed.sort(key=lambda j: (tree.nodes[j].depth, j))
        t0 = decode_clock()
        rows = d.tree_level(feed, [tree.nodes[j].token for j in feed], [tree.nodes[j].parent for j in feed])  # [w, V]
        tree.timings.append(CallTiming(i, len(feed), decode_clock() - t0))
        tree.forwards += 1
        for r, j in enumerate(feed):
            out[j] = rows[r]
        return {x: out[x] for x in expand}

    def chain(self, tree: Tree, i: int, n: int, stop_below: float) -> list[tuple[int, float]]:
        """LM drafter i's argmax tokens below the root, up to ``n``, going on while each is at
        least ``stop_below`` likely (the last one drafted may be less): (token, drafter
        probability) per depth. One timed forward per token, as ``forward`` times its calls."""
        d: LMDrafter = self.drafters[i]
        steps = d.chain_steps(tree.context)
        stop = ConfidenceStop(stop_below)  # the rule LMDrafter(stop_below=...) stops its chain by
        chain: list[tuple[int, float]] = []
        try:
            t0 = decode_clock()
            logits = next(steps)  # [V]
            while True:
                tree.timings.append(CallTiming(i, 1, decode_clock() - t0))
                tree.forwards += 1
                probs = torch.softmax(logits.float(), -1)  # [V]
                token = int(logits.argmax())
                chain.append((token, float(probs[token])))
                if len(chain) >= n or not stop.should_continue(len(chain) - 1, probs):
                    return chain
                t0 = decode_clock()
                logits = steps.send(token)
        finally:
            steps.close()

    def lookup(self, tree: Tree, i: int, node: int) -> tuple[int | None, torch.Tensor | None]:
        """A forward-free drafter's one proposal below ``node``: (token, q [V] or None)."""
        t0 = decode_clock()
        block = self.drafters[i].propose(tree.context + tree.path_tokens(node), 1)
        charge_lookup()
        tree.timings.append(CallTiming(i, 0, decode_clock() - t0))
        if not block.k:
            return None, None
        return int(block.tokens[0]), None if block.q is None else block.q[0]

    @staticmethod
    def ranked(tree: Tree, node: int, logits: torch.Tensor, count: int) -> list[tuple[int, float]]:
        """Up to ``count`` (token, drafter probability) of the highest-ranked tokens at ``node``
        that are not already a deterministic child of it."""
        probs = torch.softmax(logits.float(), -1)  # [V]
        taken = tree.taken.get(node, set())
        top = torch.topk(probs, min(count + len(taken), probs.shape[-1]))
        return [(int(t), float(p)) for p, t in zip(top.values, top.indices) if int(t) not in taken][:count]

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution [V] a sampled child is drawn from (the run's warping)."""
        return logits_to_probs(logits, self.sampling)

    def draw(self, q: torch.Tensor) -> int:
        return int(sample(q, self.generator))
