"""N-gram drafter: prompt lookup over the context, plus an optional corpus-built n-gram table.

Deterministic (``q=None``): the verifier treats each drafted token as one-hot, so drafting by
lookup is lossless under sampling too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cascade.drafters.base import Drafter
from cascade.types import DraftBlock


def lookup_context(context: list[int], n: int, budget: int) -> list[int]:
    """Prompt lookup: up to ``budget`` tokens that followed the most recent earlier occurrence of
    the context's last ``n`` tokens ([] when there is none)."""
    pattern = context[-n:]
    last = len(context) - n  # start of the pattern itself; matches must start before it
    first = pattern[0]
    for i in range(last - 1, -1, -1):
        if context[i] == first and context[i : i + n] == pattern:
            return context[i + n : i + n + budget]
    return []


class NGramDrafter(Drafter):
    kind = "ngram"
    """Prompt lookup decoding (Saxena, 2023), with a fallback corpus table.

    The last ``n`` tokens of the context (``n`` from ``max_ngram`` down to ``min_ngram``) are
    searched for earlier in the context; the tokens that followed the most recent earlier match
    are proposed (at most ``k``, the max match length). When the context has no match, a table
    built from ``corpus`` (token sequences) is consulted the same way.
    """

    def __init__(
        self,
        k: int = 8,
        max_ngram: int = 3,
        min_ngram: int = 1,
        corpus: Iterable[list[int]] | None = None,
        name: str = "ngram",
    ) -> None:
        if k < 1:
            raise ValueError(f"k (max match length) must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.k, self.max_ngram, self.min_ngram, self.name = k, max_ngram, min_ngram, name
        self.table: dict[tuple[int, ...], list[int]] = {}
        for seq in corpus or ():
            self._add_to_table(list(seq))

    def _add_to_table(self, seq: list[int]) -> None:
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(len(seq) - n):
                # first occurrence wins: a table is a fixed prior, not a recency cache
                self.table.setdefault(tuple(seq[i : i + n]), seq[i + n : i + n + self.k])

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        budget = min(budget, self.k)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            found = lookup_context(context, n, budget)
            if found:
                return DraftBlock(torch.tensor(found, dtype=torch.long), None, self.name)
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            found = self.table.get(tuple(context[-n:]), [])[:budget]
            if found:
                return DraftBlock(torch.tensor(found, dtype=torch.long), None, self.name)
        return DraftBlock.empty(self.name)
