"""Small-LM drafter: a smaller causal LM with its own KV cache.

The cache is kept in sync with the accepted prefix by token bookkeeping: the drafter remembers
which tokens its cache holds, and before drafting it crops the cache to the longest common
prefix with the context and feeds only the tokens it has not seen (typically the
recovered/bonus token, or the last draft token plus the bonus after a full acceptance).
"""

from __future__ import annotations

import torch

from cascade.drafters.base import DraftStart, SharesCache
from cascade.drafters.lm_base import LMDrafter, crop_to_prefix, keep_tree_entries
from cascade.drafters.stopping import StopPolicy
from cascade.models.lm import CausalLM

__all__ = ["SmallLMDrafter"]


class SmallLMDrafter(LMDrafter, SharesCache):
    """Drafts up to ``k`` tokens autoregressively with ``model`` (see ``LMDrafter`` for
    ``sample``, ``stop`` and ``stop_below``)."""

    kind = "small_lm"

    def __init__(
        self,
        model: CausalLM,
        k: int = 4,
        sample: bool = True,
        stop: StopPolicy | None = None,
        stop_below: float | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(k=k, sample=sample, stop=stop, stop_below=stop_below)
        self.model = model
        self.name = name or f"small_lm({model.name})"
        self.cache = None  # made at each start
        self.cached: list[int] = []  # tokens whose keys/values the cache holds, in order

    def draft_cache(self):
        return None if self.cache is None else (self.model, self.cache)

    def start(self, run: DraftStart) -> None:
        self.cache = self.model.new_cache()
        self.cached = []
        super().start(run)  # catches up on the prompt in the new cache

    def sync(self, context: list[int]) -> int:
        """Crop the cache to its longest common prefix with ``context`` (at most all but its last
        token), so that it holds a prefix of ``context``; returns that length. A lower cascade
        level sharing this cache (a layer skip of this model) relies on it."""
        self.cached = crop_to_prefix(self.model, self.cache, self.cached, context)
        return len(self.cached)

    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        """This model's logits after ``context`` and after each token of ``extra``, in one
        forward: [len(extra) + 1, V]. The cache is first cropped to its longest common prefix
        with ``context``; afterwards it holds ``context + extra``."""
        keep = self.sync(context)
        new = context[keep:] + list(extra)
        self.cached = self.cached + new
        return self.model.forward(new, self.cache, keep_last=len(extra) + 1)

    def _continue(self, token: int) -> torch.Tensor:
        self.cached.append(token)
        return self.model.forward([token], self.cache)[-1]

    # ---- tree levels: the nodes sit in the cache after the context; ``cached`` stays the
    #      context, so a sync before ``tree_commit`` crops them away
    def _forward_nodes(self, tokens: list[int], positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model.forward(tokens, self.cache, position_ids=positions, attention_mask=mask)  # [w, V]

    def tree_commit(self, path: list[int]) -> None:
        t = self._tree
        if t is None:
            return
        keep = []
        for node in path:  # the accepted path's prefix that was fed
            if node not in t.slot:
                break
            keep.append(t.slot[node])
        self.cached = keep_tree_entries(self.model, self.cache, self.cached, t.base, t.tokens, keep, self.name)
        self._tree = None
