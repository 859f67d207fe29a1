"""`DraftHeadDrafter`: drafts with an EAGLE-style head on the target's own features.

The head (``cascade.models.heads.eagle.DraftHead``) needs the target's feature f_t (the LM head's
input) at every committed position; the drafter asks the decode loop for them
(``hidden_layer = FINAL_HIDDEN``), which reads them from the target's own forwards: the prompt's
at prefill, the committed path's after each verification (in tree order for a tree). An EAGLE-3
head (``cascade.models.heads.eagle3.Eagle3Head``) asks for three layers' states instead
(``hidden_layer`` is then the head's tuple of layers) and is driven the same way.

Positions. With committed tokens x_0..x_T (x_T the root, the last token, whose feature the next
verification computes) the loop has handed over f_0..f_{T-1}. The head's input at head position
t is (f_t, x_{t+1}); its cache holds entries 0..T-2 computed from the target's features, and a
draft starts by feeding (f_{T-1}, x_T) at T-1, whose output f^_T gives the first draft token's
distribution. Each further draft token d is fed as (f^ of its parent, d): positions from T on
are computed from the head's own predicted features, so they are dropped when the draft ends
(``_end_draft``), and the next draft recomputes the accepted ones from the target's features.

A chain drafter (k, every stop policy), a level-by-level tree drafter (one head forward per depth
for every node expanded there), and the top level of a vertical cascade (``score`` runs the head
over tokens beyond the committed prefix on its own features). It cannot be a lower cascade level:
nobody hands it the target's features there (refused by ``VerticalCascade``).
"""

from __future__ import annotations

import torch
from torch import nn

from cascade.costs import ForwardShape, linear_bytes
from cascade.drafters.base import DraftStart, Outcome
from cascade.drafters.lm_base import LMDrafter, TreeCacheState
from cascade.drafters.stopping import StopPolicy
from cascade.models.heads.eagle import DraftHead
from cascade.models.heads.eagle3 import Eagle3Head, open_head
from cascade.models.lm import FINAL_HIDDEN, CausalLM, HiddenLayers, notify_forward


class DraftHeadDrafter(LMDrafter):
    """Drafts with a ``DraftHead`` (see the module docstring)."""

    kind = "draft_head"

    def __init__(self, head: DraftHead | Eagle3Head | str, k: int = 4, sample: bool = True, stop: StopPolicy | None = None,
                 stop_below: float | None = None, name: str | None = None) -> None:
        """head: a ``DraftHead`` or ``Eagle3Head``, a checkpoint path (``python -m
        cascade.train_head``), a published EAGLE-1/2 or EAGLE-3 head (its directory or weight
        file: ``cascade.models.heads.eagle3.open_head``), or "init" (untrained, built from the target:
        for debug runs and tests)."""
        super().__init__(k=k, sample=sample, stop=stop, stop_below=stop_below)
        self._head_spec = head
        self.head: DraftHead | Eagle3Head | None = head if isinstance(head, (DraftHead, Eagle3Head)) else None
        self.name = name or "draft_head"
        self.model: CausalLM | None = None
        self._readout = None
        self._feats: torch.Tensor | None = None  # [T, F] the target's features of committed positions 0..T-1 (F = head.feature_size)
        self._cache = None  # the head's own cache, made at each start
        self._true_len = 0  # head cache entries computed from the target's features (positions 0.._true_len-1)
        self._last: torch.Tensor | None = None  # [H] the head's predicted feature after the last token fed
        self._node_feats: list[torch.Tensor] = []  # tree drafting: predicted feature of each fed node (by slot)

    # ---- binding -------------------------------------------------------------------------
    def check_compatible(self, target: CausalLM) -> None:
        if self.model is target:
            return
        if self.head is None or self._head_spec == "init":
            self.head = DraftHead.from_target(target) if self._head_spec == "init" else open_head(self._head_spec, target)
        self.head.for_inference(target)  # refuses a head built for another target
        self._readout = self.head.readout(target)
        self.model = target

    @property
    def hidden_layer(self) -> HiddenLayers:
        """The target states the head reads: the last layer's feature, or (EAGLE-3) three layers'
        (known once a loaded head is bound; FINAL_HIDDEN before)."""
        return FINAL_HIDDEN if self.head is None else self.head.hidden_layer

    def start(self, run: DraftStart) -> None:
        self.check_compatible(run.target)
        self._cache = self.head.new_cache()
        self._true_len, self._last, self._node_feats = 0, None, []
        super().start(run)

    def _prefill(self, run: DraftStart) -> None:
        """Keep the prompt's features (``run.hidden``: [len(prompt) - 1, H]); the head's cache
        fills lazily at the first proposal."""
        self._feats = run.hidden

    def observe(self, outcome: Outcome) -> None:
        super().observe(outcome)
        if outcome.hidden is not None:  # [m, H] the positions just committed
            self._feats = outcome.hidden if self._feats is None else torch.cat([self._feats, outcome.hidden])

    # ---- the head's forwards ------------------------------------------------------------------
    def forward_shape(self) -> ForwardShape:
        """One head forward as a roofline sees it: the head's layer(s) and the LM head it reads out through."""
        nbytes, count = linear_bytes(nn.ModuleList([self.head, self._readout]))
        target = ForwardShape.of(self.model)
        per_layer = target.kv_values_per_position // target.layers
        return ForwardShape(nbytes, count, 1, per_layer, target.attention_flops_per_position / target.layers)

    @torch.inference_mode()
    def _step(self, features: torch.Tensor, tokens: list[int], positions: torch.Tensor,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed (features [n, H], tokens [n]) at head ``positions`` [n] -> (predicted features
        [n, H], logits [n, V])."""
        if self._cache is not None:
            notify_forward(self.head, f"head:{self.model.name}", self.forward_shape, len(tokens), self.head.cache_len(self._cache))
        out = self.head(self.model, features, torch.tensor(tokens), positions, self._cache, mask)  # [n, H]
        return out, self._readout(out.to(self.model.dtype))

    def _root(self, context: list[int]) -> torch.Tensor:
        """Bring the head's cache to the committed prefix (target features only) and feed the
        root (f_{T-1}, x_T): logits [V] of the first draft token."""
        if self.model is None:
            raise RuntimeError(f"{self.name} is not bound to a target: use it through cascade.generate")
        t = 0 if self._feats is None else self._feats.shape[0]
        if t == 0 and len(context) >= 1:  # a one-token prompt, before the first verification: no
            # target feature exists yet; the root is fed a zero feature (a poor draft, exact q) and
            # dropped with the draft (_true_len 0)
            self.head.crop(self._cache, 0)
            self._true_len = 0
            zero = torch.zeros(1, self.head.feature_size, dtype=self.model.dtype, device=self.model.device)
            feats, logits = self._step(zero, context[:1], torch.tensor([0]))
            self._last = feats[-1]
            return logits[-1]
        if len(context) < t + 1:
            raise RuntimeError(
                f"{self.name} has the target's features of {t} positions for a context of {len(context)} tokens: a "
                "draft head drafts directly for the target (alone, in a tree, or as the top of a cascade)")
        self.head.crop(self._cache, min(self._true_len, t - 1))
        done = self.head.cache_len(self._cache)
        feats, logits = self._step(self._feats[done:t], context[done + 1 : t + 1], torch.arange(done, t))
        self._true_len = t
        self._last = feats[-1]
        return logits[-1]

    def _start_draft(self, context: list[int]) -> torch.Tensor:
        """The root's logits, then (a cascade's top level) the context's tokens beyond the
        committed prefix, fed on the head's own features."""
        logits = self._root(context)
        for token in context[self._true_len + 1 :]:
            logits = self._continue(token)
        return logits

    def _continue(self, token: int) -> torch.Tensor:
        position = torch.tensor([self.head.cache_len(self._cache)])
        feats, logits = self._step(self._last.unsqueeze(0), [token], position)
        self._last = feats[-1]
        return logits[-1]

    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        """Logits after ``context`` and after each token of ``extra`` [len(extra) + 1, V]: one head
        forward per token beyond the committed prefix (each needs its predecessor's feature)."""
        try:
            rows = [self._start_draft(context)]
            rows += [self._continue(token) for token in extra]
            return torch.stack(rows)
        finally:
            self._end_draft()

    def _end_draft(self) -> None:
        """Drop the entries computed from predicted features (idempotent)."""
        if self._cache is not None and self.head.cache_len(self._cache) > self._true_len:
            self.head.crop(self._cache, self._true_len)

    def propose(self, context: list[int], budget: int):
        try:
            return super().propose(context, budget)
        finally:
            self._end_draft()

    # ---- tree levels: nodes sit in the head's cache after the committed entries ------------------
    def tree_start(self, context: list[int]) -> torch.Tensor:
        logits = self._start_draft(context)
        # the head's cache holds positions 0..T-1 (the root's entry last): one fewer than the context
        self._tree = TreeCacheState(self.head.cache_len(self._cache))
        self._node_feats = []
        return logits

    def _forward_nodes(self, tokens: list[int], positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each node is fed its parent's predicted feature, so a node whose parent is in the same
        call (a tree policy feeding a path another drafter proposed) waits for a later forward:
        the call runs in waves, each over nodes whose parents are already fed."""
        t = self._tree
        w = len(tokens)
        first = len(t.ids) - w  # slot of this call's first node
        parents = t.parents[-w:]  # slots of the parents (-1: the root)
        rows, a = [], 0
        while a < w:
            b = a + 1  # node a's parent comes before it: fed before this wave
            while b < w and parents[b] < first + a:
                b += 1
            feats = torch.stack([self._last if p == -1 else self._node_feats[p] for p in parents[a:b]])  # [b-a, H]
            cols = mask.shape[-1] - (w - b)  # the nodes after this wave are not in the cache yet
            out, logits = self._step(feats, tokens[a:b], positions[a:b], mask[:, :, a:b, :cols])
            self._node_feats.extend(out.unbind(0))
            rows.append(logits)
            a = b
        return torch.cat(rows)  # [w, V]

    def tree_commit(self, path: list[int]) -> None:
        """Nothing to keep: the accepted nodes are recomputed from the target's features at the
        next draft (``tree_end`` dropped every node)."""
        self._tree = None
        self._node_feats = []
