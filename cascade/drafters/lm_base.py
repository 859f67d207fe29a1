"""`LMDrafter`: what every drafter backed by a language model shares.

A subclass provides the model access:

    score(context, extra) -> logits [len(extra) + 1, V]
        the model's next-token logits after ``context`` and after each token of ``extra``
        (used to start a draft, and by a vertical cascade to verify the level below)
    _start_draft(context) -> logits [V]
        the first step of a draft (default: the last row of ``score``)
    _continue(token) -> logits [V]
        one more draft token on top of the last ``_start_draft``/``_continue`` call
    _end_draft()
        drop whatever drafting left behind that must not survive (shared-cache drafters)

and this class drafts: up to ``k`` tokens, argmax or sampled (reporting the exact processed
``q``), ended early by a stop policy (``cascade.drafters.stopping``) whose decisions are logged
in the block's ``stop`` field and which learns from each verification result.

Level-synchronous tree drafting (``cascade.trees.drafter``) uses these calls, one drafter
forward per tree depth over every node expanded at that depth:

    tree_start(context) -> logits [V]            the root's (the cache then holds ``context``)
    tree_level(nodes, tokens, parents) -> [w, V]  feed w tree nodes at once, with tree positions
                                                  and the tree mask (``cascade.tree_structure.level_inputs``)
    tree_fed(node) -> bool                        whether a node is already in the draft cache
    tree_end()                                    drop what must not outlive the draft
    tree_commit(path)                             after verification: keep the accepted path

and a tree policy that drafts a chain asks for the chain drafter's own path instead
(``chain_steps``: ``_start_draft``, then ``_continue`` per token, then ``_end_draft``): one-token
forwards without tree positions or masks, the code and cost of ``propose``.

A subclass provides ``_forward_nodes(tokens, positions, mask)``; ``tree_commit`` compacts the
drafter's own cache to the accepted path with the compaction the target uses
(``CausalLM.compact``); a drafter on the target's cache (layer skip) drops its nodes in
``tree_end`` instead and gets the accepted path from the target's own commit.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from cascade.costs import ForwardShape
from cascade.drafters.base import ChecksTarget, Drafter, DraftStart, Outcome
from cascade.drafters.stopping import FixedK, StopPolicy, make_stop_policy
from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.tree_structure import level_inputs
from cascade.types import DraftBlock, DrafterInfo


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def crop_to_prefix(model: CausalLM, cache, cached: list[int], tokens: list[int]) -> list[int]:
    """Crop ``cache`` (which holds ``cached``) to its longest common prefix with ``tokens``, at
    most all of ``tokens`` but the last (so the next forward has an input); returns what it then
    holds. A drafter with its own cache calls this before every draft."""
    keep = min(common_prefix_len(cached, tokens), len(tokens) - 1)
    model.crop(cache, keep)
    return cached[:keep]


def keep_tree_entries(model: CausalLM, cache, cached: list[int], base: int, fed: list[int], keep: list[int],
                      name: str) -> list[int]:
    """After a tree draft on a drafter's own cache (which holds ``cached``, the context's ``base``
    entries, then one entry per token of ``fed``): keep the entries ``keep`` (indices into
    ``fed``: the accepted path's fed prefix, in order) and drop the others. Returns what the
    cache then holds. The one place a tree's nodes are committed to a drafter's cache."""
    if model.cache_len(cache) != base + len(fed) or len(cached) != base:
        raise RuntimeError(f"{name}: the draft cache changed between tree_start and tree_commit")
    model.compact(cache, base, keep)
    return cached + [fed[j] for j in keep]


def check_same_vocabulary(drafter_lm: CausalLM, target: CausalLM) -> None:
    """Refuse a drafter whose distributions do not index the target's vocabulary."""
    if drafter_lm.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {drafter_lm.name!r} has vocabulary size {drafter_lm.vocab_size}, target "
            f"{target.name!r} has {target.vocab_size}: they must share one tokenizer"
        )
    if drafter_lm.tokenizer is not None and target.tokenizer is not None:
        if drafter_lm.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(
                f"drafter {drafter_lm.name!r} and target {target.name!r} have different tokenizers "
                "(same size, different token -> id maps): drafted ids would mean other tokens"
            )


@dataclass
class TreeCacheState:
    """Which tree nodes a drafter's cache holds during a level-synchronous tree draft."""

    base: int  # cached positions before the first node: the context (the root is its last)
    ids: list[int] = field(default_factory=list)  # caller's node ids, in cache order
    parents: list[int] = field(default_factory=list)  # parent of each fed node, as an index into ids (-1 = root)
    tokens: list[int] = field(default_factory=list)
    slot: dict[int, int] = field(default_factory=dict)  # caller's node id -> index into ids


class LMDrafter(Drafter, ChecksTarget):
    """Base of the LM-backed drafters.

    k: maximum draft length.
    sample: when the run samples (temperature > 0), sample draft tokens and report their exact
        ``q``; when False, always draft the argmax (``q=None``, one-hot) — also lossless.
    stop: a stop policy (``FixedK``, ``ConfidenceStop``, ``ThompsonStop``); ``stop_below`` is the
        shorthand for ``ConfidenceStop(stop_below)``.
    """

    model: CausalLM  # the model whose distributions this drafter reports (for vocabulary checks)

    def __init__(self, k: int = 4, sample: bool = True, stop: StopPolicy | None = None, stop_below: float | None = None) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must lie in [0, 1], got {stop_below}")
        self.k, self.sample = k, sample
        self.stop: StopPolicy = make_stop_policy(stop, stop_below)
        self._compatible_with: set[int] = set()
        self._tree: TreeCacheState | None = None

    def forward_shape(self) -> ForwardShape:
        """One of its forwards as a roofline sees it (``cascade.costs``): its model's, by default."""
        return ForwardShape.of(self.model)

    def check_compatible(self, target: CausalLM) -> None:
        if id(target) not in self._compatible_with:
            check_same_vocabulary(self.model, target)
            self._compatible_with.add(id(target))

    def scores_vocabulary_of(self, target: CausalLM) -> CausalLM:
        """The model whose vocabulary this drafter's ``score`` rows index when it drafts for
        ``target``: a level below it in a vertical cascade must draft in that vocabulary."""
        return self.model

    def start(self, run: DraftStart) -> None:
        """A new generation; a subclass drops its own state first, then calls this, which ends
        with the prompt's catch-up (``_prefill``)."""
        super().start(run)
        self.stop.reset(run.generator)
        self._tree = None
        self._prefill(run)

    @abstractmethod
    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        """Logits after ``context`` and after each token of ``extra``: [len(extra) + 1, V]."""

    @abstractmethod
    def _continue(self, token: int) -> torch.Tensor:
        """Logits [V] after appending ``token`` to what the last call processed."""

    def _start_draft(self, context: list[int]) -> torch.Tensor:
        """Logits [V] after ``context``, the first step of a draft that ``_continue`` extends."""
        return self.score(context)[-1]

    def _end_draft(self) -> None:
        """Called when a draft is complete."""

    # ---- level-synchronous tree drafting ------------------------------------------------------
    def _forward_nodes(self, tokens: list[int], positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits [w, V] of ``tokens`` fed on top of the draft cache at ``positions`` [w] with the
        4D ``mask`` [1, 1, w, cache_len + w]; the cache grows by w."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft a tree level by level")

    def tree_start(self, context: list[int]) -> torch.Tensor:
        """Start a tree below the last token of ``context``: the root's logits [V]."""
        logits = self._start_draft(context)  # the cache now holds all of context
        self._tree = TreeCacheState(len(context))
        return logits

    def tree_level(self, nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Feed tree nodes ``nodes`` (the caller's ids) with ``tokens`` and ``parents`` (caller's
        ids, -1 = root; each already fed, or earlier in this call) in one forward: logits [w, V],
        each row the model's next-token logits after the path to that node."""
        t = self._tree
        if t is None:
            raise RuntimeError(f"{self.name}: tree_level before tree_start")
        for node, token, parent in zip(nodes, tokens, parents):
            if parent != -1 and parent not in t.slot:
                raise ValueError(f"tree node {node}'s parent {parent} has not been fed to {self.name}")
            t.slot[node] = len(t.ids)
            t.ids.append(node)
            t.parents.append(-1 if parent == -1 else t.slot[parent])
            t.tokens.append(token)
        positions, mask = level_inputs(t.parents, t.base - 1, len(nodes), self.model.dtype)
        return self._forward_nodes(list(tokens), positions.to(self.model.device), mask.to(self.model.device))

    def chain_steps(self, context: list[int]) -> Generator[torch.Tensor, int, None]:
        """The chain path of ``propose`` as a coroutine: yields the logits [V] after ``context``,
        then after each token sent to it; closing it ends the draft (``_end_draft``) and leaves
        the drafter as ``propose`` does (the next draft syncs its cache to the context)."""
        try:
            logits = self._start_draft(context)
            while True:
                token = yield logits
                logits = self._continue(token)
        finally:
            self._end_draft()

    def tree_fed(self, node: int) -> bool:
        """Whether tree node ``node`` (caller's id) is in the draft cache of the current tree."""
        return self._tree is not None and node in self._tree.slot

    def tree_end(self) -> None:
        """The tree is complete (called before the target verifies it)."""
        self._end_draft()

    def tree_commit(self, path: list[int]) -> None:
        """After verification: ``path`` holds the accepted tree nodes (caller's ids, root's child
        first). A drafter with its own cache keeps the fed prefix of that path and drops every
        other node (``SmallLMDrafter``). This default keeps nothing: it suits a drafter on the
        target's cache, whose nodes ``tree_end`` dropped and whose accepted path the target's own
        commit keeps (layer skip; a Kangaroo adapter gets its states through ``observe``)."""
        self._tree = None

    def describe(self) -> DrafterInfo:
        return DrafterInfo(kind=self.kind, name=self.name, budget=self.k, stop=type(self.stop).__name__)

    def _prefill(self, run: DraftStart) -> None:
        """Run the model over all but the last prompt token, so that the first proposal feeds
        only that one (a drafter on the target's own cache overrides this: nothing to catch up)."""
        if len(run.prompt) > 1:
            self.score(run.prompt[:-1])

    def sync(self, context: list[int]) -> int:
        """Make the KV cache of ``self.model`` hold a prefix of ``context`` (nothing else); return
        its length. Called by a vertical cascade before the level below (which may share that
        cache) drafts."""
        return 0

    def _draft_chain(self, logits: torch.Tensor, n: int, deterministic: bool,
                     step: Callable[[int], torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``n`` tokens from first-step ``logits`` [V]: argmax (``deterministic``) or sampled
        from the processed distribution, asking the stop policy after each (the caller started
        it); ``step(token)`` returns the next logits. Returns the tokens and, when sampled, each
        one's q [V]."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(n):
            if deterministic:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, self.sampling)  # [V]
                token = int(sample(q, self.generator))
                qs.append(q)
            tokens.append(token)
            if i == n - 1:
                break
            if not isinstance(self.stop, FixedK):
                if not self.stop.should_continue(i, torch.softmax(logits.float(), -1)):
                    break
            logits = step(token)
        return tokens, qs

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        n = min(budget, self.k)
        deterministic = self.sampling.greedy or not self.sample
        self.stop.start_draft()
        tokens, qs = self._draft_chain(self._start_draft(context), n, deterministic, self._continue)
        self._end_draft()
        q = torch.stack(qs) if qs else None  # [k, V]
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), q, self.name, stop=list(self.stop.decisions))

    def observe(self, outcome: Outcome) -> None:
        self.stop.update(outcome.result.num_accepted, not outcome.result.all_accepted)
