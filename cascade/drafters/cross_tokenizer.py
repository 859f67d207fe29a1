"""A drafter from another model family: its own tokenizer, its own KV cache, the target's ids out.

``CrossTokenizerDrafter(model)`` drafts for any target whose vocabulary, like the drafter's, is
byte-level BPE (``cascade.models.vocabulary``). It reads the committed text (the target's ids
turned into bytes and re-tokenized with its own tokenizer) and proposes target ids by one of two
rules (Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies"):

string-level exact match (``rule="string"``)
    It drafts ``k`` tokens of its own vocabulary by argmax, turns them into bytes and
    re-tokenizes those into target ids after the context
    (``VocabularyBridge.target_continuation``); the proposal is deterministic (``q=None``), so
    the target verifies it as one-hot rows: lossless under greedy decoding and under sampling.
    The drafter's text only proposes; every emitted token is the target's.
token-level intersection (``rule="intersection"``)
    Its next-token logits are mapped onto the target's vocabulary: the tokens that are the same
    byte string in both keep their logits, every other target token gets -inf
    (``VocabularyBridge.target_logits``). Processed with the run's temperature / top-k / top-p,
    that is the drafter's distribution restricted to the intersection and renormalised, and it
    is exactly the ``q`` each drafted token is sampled from, so standard rejection keeps the
    target's distribution. A drafted token is shared, i.e. one token of the drafter too, fed on
    as that token.

``rule="auto"`` (the default): a chain drafted in a greedy run (or with ``sample=False``) uses
string-level match, a sampled chain the intersection. Wherever the drafter is asked for its
distribution at given target tokens instead of a chain of its own — as the top level of a
vertical cascade (``score``) and in token trees (level-synchronous ``tree_level``) — it uses the
intersection whatever the rule: string-level match has no per-token distribution.

Conditioning. The drafter's input for a context is the drafter tokenization of the context's
bytes; a target token appended to it (a drafted, a scored or a tree node's token) is fed as its
``drafter_piece`` (the shared token, or its bytes tokenized alone; a tree node may thus span
several cache entries). Each position's distribution is a function of its past only, which is
what the lossless rules need. Before each draft the cache is cropped to its longest common
prefix with the context's fresh tokenization (the last position where the two tokenizations
still agree) and the rest is fed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cascade.drafters.base import DraftStart, SharesCache
from cascade.drafters.lm_base import LMDrafter, crop_to_prefix, keep_tree_entries
from cascade.drafters.stopping import StopPolicy
from cascade.models.vocabulary import ByteVocabulary, VocabularyBridge, complete_utf8_prefix
from cascade.models.lm import CausalLM
from cascade.tree_structure import level_inputs
from cascade.types import DraftBlock, DrafterInfo, Retokenization

RULES = ("auto", "string", "intersection")


@dataclass
class _PieceTree:
    """The tree nodes a cross-tokenizer drafter's cache holds during a level-synchronous draft:
    each node is one or more cache entries (its token's drafter piece)."""

    base: int  # cached drafter tokens before the first node (the context; the root is its last)
    parents: list[int] = field(default_factory=list)  # per entry: its parent entry (-1 = root)
    tokens: list[int] = field(default_factory=list)  # per entry: the drafter token
    path: dict[int, list[int]] = field(default_factory=dict)  # caller's node id -> its path's entries


class CrossTokenizerDrafter(LMDrafter, SharesCache):
    """Drafts for a target with another tokenizer (see the module docstring for the rules).

    model: the drafter's ``CausalLM`` (with its tokenizer). k: drafter tokens per draft under
    string-level match, target tokens under the intersection (a draft never holds more than the
    caller's budget of target tokens). rule: "auto", "string" or "intersection". sample, stop,
    stop_below: as for every LM drafter (``LMDrafter``).
    """

    kind = "cross_tokenizer"

    def __init__(self, model: CausalLM, k: int = 4, sample: bool = True, stop: StopPolicy | None = None,
                 stop_below: float | None = None, rule: str = "auto", name: str | None = None) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        super().__init__(k=k, sample=sample, stop=stop, stop_below=stop_below)
        self.model, self.rule = model, rule
        self.name = name or f"cross({model.name})"
        self.vocabulary = ByteVocabulary.of_model(model)
        self._bridges: dict[int, VocabularyBridge] = {}
        self.bridge: VocabularyBridge | None = None
        self.counts = Retokenization()
        self._drafting = False  # inside an intersection chain's propose (its rows are counted)
        self._pieces: _PieceTree | None = None
        self.cache = None  # made at each start
        self.cached: list[int] = []  # drafter tokens whose keys/values the cache holds, in order

    # ---- the vocabulary it drafts in ----------------------------------------------------------
    def check_compatible(self, target: CausalLM) -> None:
        """Build (once per model) the bridge to ``target``'s vocabulary and draft in it from now on."""
        if id(target) not in self._bridges:
            self._bridges[id(target)] = VocabularyBridge(ByteVocabulary.of_model(target), self.vocabulary)
        self.bridge = self._bridges[id(target)]

    def scores_vocabulary_of(self, target: CausalLM) -> CausalLM:
        return target  # its score rows index the vocabulary of the model it drafts for

    def _bridge(self) -> VocabularyBridge:
        if self.bridge is None:
            raise RuntimeError(f"{self.name}: check_compatible(target) must run before drafting (it builds the vocabulary bridge)")
        return self.bridge

    def string_match(self) -> bool:
        """Whether this run's chains use string-level match (else the intersection)."""
        if self.rule == "auto":
            return self.sampling.greedy or not self.sample
        return self.rule == "string"

    # ---- cache ----------------------------------------------------------------------------------
    def draft_cache(self):
        return None if self.cache is None else (self.model, self.cache)

    def start(self, run: DraftStart) -> None:
        self.cache = self.model.new_cache()
        self.cached = []
        self._pieces = None
        super().start(run)  # catches up on the prompt in the new cache

    def _sync_to(self, tokens: list[int]) -> int:
        """Crop the cache to its longest common prefix with drafter ``tokens`` (at most all but
        the last); returns that length."""
        self.cached = crop_to_prefix(self.model, self.cache, self.cached, tokens)
        return len(self.cached)

    def sync(self, context: list[int]) -> int:
        return self._sync_to(self._bridge().drafter_context(context))

    def _drafter_rows(self, context: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """The drafter's own logits [len(pieces) + 1, Vd] after ``context`` and after each piece
        appended in turn, in one forward."""
        base = self._bridge().drafter_context(context)
        if not base:
            raise ValueError(f"{self.name}: the context has no bytes to draft from")
        keep = self._sync_to(base)
        new = base[keep:] + [t for p in pieces for t in p]
        ends = [len(base) - keep - 1]  # index into `new` of the last input before each row
        for p in pieces:
            ends.append(ends[-1] + len(p))
        logits = self.model.forward(new, self.cache, keep_last=len(new) - ends[0])  # [len(new) - ends[0], Vd]
        self.cached = self.cached + new
        return logits[torch.tensor(ends) - ends[0]]

    # ---- LMDrafter's model access, in the target's vocabulary (the intersection) ----------------
    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        bridge = self._bridge()
        return self._in_target_vocabulary(self._drafter_rows(context, [bridge.drafter_piece(t) for t in extra]))  # [j + 1, Vt]

    def _continue(self, token: int) -> torch.Tensor:
        piece = self._bridge().drafter_piece(token)
        self.cached = self.cached + piece
        return self._in_target_vocabulary(self.model.forward(piece, self.cache)[-1:])[0]  # [Vt]

    def _continue_drafter(self, token: int) -> torch.Tensor:
        """The drafter's own logits [Vd] after appending its own ``token`` (string match)."""
        self.cached = self.cached + [token]
        return self.model.forward([token], self.cache)[-1]

    def _in_target_vocabulary(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, Vd] drafter logits -> [n, Vt] (the intersection); while a chain is drafted, the
        drafter's mass on the intersection at the last row is counted (what the rule gives up)."""
        if self._drafting:
            self.counts.shared_mass += float(self._bridge().shared_mass(rows[-1]))
            self.counts.shared_rows += 1
        return self._bridge().target_logits(rows)

    # ---- chains ---------------------------------------------------------------------------------
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        if self.string_match():
            return self._propose_string(context, budget)
        self._drafting = True
        try:
            block = super().propose(context, budget)
        finally:
            self._drafting = False
        self.counts.drafts += 1
        self.counts.drafted += block.k
        self.counts.proposed += block.k
        return block

    def _propose_string(self, context: list[int], budget: int) -> DraftBlock:
        """String-level exact match: argmax drafter tokens, re-tokenized into target ids."""
        bridge = self._bridge()
        n = min(budget, self.k)
        self.stop.start_draft()
        drafted, _ = self._draft_chain(self._drafter_rows(context, [])[-1], n, True, self._continue_drafter)
        text = self.vocabulary.bytes_of(drafted)
        tokens = bridge.target_continuation(context, complete_utf8_prefix(text))[:budget]
        self.counts.drafts += 1
        self.counts.drafted += len(drafted)
        self.counts.proposed += len(tokens)
        self.counts.drafted_bytes += len(text)
        self.counts.proposed_bytes += len(bridge.target.bytes_of(tokens))
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), None, self.name, stop=list(self.stop.decisions))

    # ---- token trees: the intersection, a node's piece may span several cache entries -----------
    def tree_start(self, context: list[int]) -> torch.Tensor:
        logits = self.score(context)[-1]  # the cache now holds the context's drafter tokens
        self._pieces = _PieceTree(len(self.cached))
        return logits

    def tree_fed(self, node: int) -> bool:
        return self._pieces is not None and node in self._pieces.path

    def tree_level(self, nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        t = self._pieces
        if t is None:
            raise RuntimeError(f"{self.name}: tree_level before tree_start")
        first = len(t.tokens)
        last_entry: list[int] = []  # per node: its last entry (whose logits are the node's)
        for node, token, parent in zip(nodes, tokens, parents):
            if parent != -1 and parent not in t.path:
                raise ValueError(f"tree node {node}'s parent {parent} has not been fed to {self.name}")
            path = [] if parent == -1 else list(t.path[parent])
            for piece_token in self._bridge().drafter_piece(token):
                t.parents.append(path[-1] if path else -1)
                t.tokens.append(piece_token)
                path.append(len(t.tokens) - 1)
            t.path[node] = path
            last_entry.append(path[-1] - first)
        positions, mask = level_inputs(t.parents, t.base - 1, len(t.tokens) - first, self.model.dtype)
        logits = self.model.forward(t.tokens[first:], self.cache, position_ids=positions.to(self.model.device),
                                    attention_mask=mask.to(self.model.device))  # [entries, Vd]
        return self._bridge().target_logits(logits[torch.tensor(last_entry)])  # [w, Vt]

    def tree_end(self) -> None:
        """Nothing to drop: the nodes stay in the cache until ``tree_commit`` compacts it."""

    def tree_commit(self, path: list[int]) -> None:
        t = self._pieces
        if t is None:
            return
        keep: list[int] = []  # the entries of the accepted path's fed prefix
        for node in path:
            if node not in t.path:
                break
            keep = t.path[node]
        self.cached = keep_tree_entries(self.model, self.cache, self.cached, t.base, t.tokens, keep, self.name)
        self._pieces = None

    def describe(self) -> DrafterInfo:
        info = super().describe()
        info.retokenization = Retokenization(**vars(self.counts))
        return info
