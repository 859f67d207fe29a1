"""Suffix lookup over a datastore (REST-style retrieval, He et al. 2023) and over the context.

:class:`Datastore` is a token corpus (documents in the target's tokenizer, concatenated with a
separator) and its suffix array, built once and cached on disk (``Datastore.cached``).
:class:`SuffixDrafter` finds the longest suffix of the context (``min_ngram`` .. ``max_ngram``
tokens) that occurs in the datastore or earlier in the context itself, and proposes what
followed it: from the datastore, the continuation most of the matches share (a majority vote
token by token over at most ``max_matches`` matches, which is REST's most frequent path); from
the context, what followed the most recent match (prompt lookup). The longer match wins; on a
tie, the context. Deterministic (``q=None``): lossless under sampling whatever it proposes.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from cascade.drafters.base import ChecksTarget, Drafter
from cascade.drafters.ngram import lookup_context
from cascade.models.lm import CausalLM
from cascade.types import DraftBlock

log = logging.getLogger(__name__)
SEP = -1  # between documents: never equal to a token, so no match or continuation crosses it


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` [N] in lexicographic order (prefix
    doubling with numpy sorts, O(N log^2 N); a shorter suffix sorts before its extensions)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)  # dense ranks 0..
    idx = np.arange(n)
    k = 1
    while True:
        second = np.where(idx + k < n, rank[np.minimum(idx + k, n - 1)] + 1, 0)  # 0: past the end
        order = np.lexsort((second, rank))
        r1, r2 = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[0], np.cumsum((r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1]))])
        rank = new
        if rank.max() == n - 1 or k >= n:
            return order.astype(np.int64)
        k *= 2


class Datastore:
    """Documents of token ids, concatenated with ``SEP``, and their suffix array."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray | None = None) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [N]
        self.sa = suffix_array(self.tokens) if sa is None else np.asarray(sa, dtype=np.int64)  # [N]
        if self.sa.shape != self.tokens.shape:
            raise ValueError("suffix array and tokens differ in length")

    @classmethod
    def build(cls, documents: Iterable[list[int]]) -> "Datastore":
        parts = []
        for doc in documents:
            if any(t < 0 for t in doc):
                raise ValueError("token ids must be non-negative")
            parts += list(doc) + [SEP]
        return cls(np.array(parts, dtype=np.int64))

    @classmethod
    def cached(cls, key: str, documents, directory: Path) -> "Datastore":
        """The datastore stored under ``directory/key.npz``, or built from ``documents()`` (a
        callable, so nothing is tokenized when the file exists) and stored there."""
        path = Path(directory) / f"{key}.npz"
        if path.is_file():
            with np.load(path) as f:
                return cls(f["tokens"], f["sa"])
        store = cls.build(documents())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, tokens=store.tokens, sa=store.sa)
        tmp.replace(path)
        log.info("datastore %s: %d tokens, written to %s", key, len(store.tokens), path)
        return store

    def __len__(self) -> int:
        return len(self.tokens)

    def _bound(self, pattern: list[int], upper: bool) -> int:
        """First suffix-array index whose suffix is >= pattern (upper: > every suffix starting with it)."""
        lo, hi, m = 0, len(self.sa), len(pattern)
        pat = np.asarray(pattern, dtype=np.int64)
        while lo < hi:
            mid = (lo + hi) // 2
            start = self.sa[mid]
            head = self.tokens[start : start + m]
            diff = np.nonzero(head != pat[: len(head)])[0]
            if diff.size:  # differs inside the pattern's length
                less = head[diff[0]] < pat[diff[0]]
            else:  # a prefix of the pattern (shorter: smaller) or starts with it
                less = len(head) < m or upper
            if less:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def matches(self, pattern: list[int]) -> tuple[int, int]:
        """Suffix-array range [lo, hi) of the suffixes starting with ``pattern``."""
        return self._bound(pattern, False), self._bound(pattern, True)

    def continuation(self, pattern: list[int], length: int, max_matches: int) -> list[int]:
        """The continuation of ``pattern`` most matches share: a majority vote token by token over
        (at most) ``max_matches`` matches, stopping at a separator or when no match is left."""
        lo, hi = self.matches(pattern)
        if lo >= hi:
            return []
        ends = self.sa[lo : min(hi, lo + max_matches)] + len(pattern)  # where each continuation starts
        out: list[int] = []
        for step in range(length):
            pos = ends + step
            nxt = self.tokens[pos[pos < len(self.tokens)]]
            if not len(nxt):
                break
            token, _ = Counter(nxt.tolist()).most_common(1)[0]
            if token == SEP:
                break
            out.append(int(token))
            ends = ends[(ends + step < len(self.tokens)) & (self.tokens[np.minimum(ends + step, len(self.tokens) - 1)] == token)]
        return out


class SuffixDrafter(Drafter, ChecksTarget):
    kind = "suffix"

    def __init__(self, datastore: Datastore | None = None, k: int = 8, max_ngram: int = 12, min_ngram: int = 2,
                 max_matches: int = 64, context: bool = True, corpus: list[str] | None = None,
                 name: str = "suffix") -> None:
        """datastore: a built ``Datastore``; or ``corpus``: names of ``cascade.data.corpus`` sets,
        tokenized with the target's tokenizer and cached on first use (``check_compatible``).
        context: also look up the context itself (prompt lookup)."""
        if k < 1:
            raise ValueError(f"k (most tokens per proposal) must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if datastore is None and not corpus and not context:
            raise ValueError("a suffix drafter needs a datastore, a corpus or context lookup")
        self.datastore, self.corpus = datastore, list(corpus or [])
        self.k, self.max_ngram, self.min_ngram, self.max_matches = k, max_ngram, min_ngram, max_matches
        self.context, self.name = context, name

    def check_compatible(self, target: CausalLM) -> None:
        if self.datastore is None and self.corpus:
            self.datastore = corpus_datastore(target, self.corpus)

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        budget = min(budget, self.k)
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            found = lookup_context(context, n, budget) if self.context and n < len(context) else []
            if not found and self.datastore is not None:
                found = self.datastore.continuation(context[-n:], budget, self.max_matches)
            if found:
                return DraftBlock(torch.tensor(found, dtype=torch.long), None, self.name)
        return DraftBlock.empty(self.name)


def corpus_datastore(target: CausalLM, names: list[str]) -> Datastore:
    """The datastore of the named corpora in ``target``'s tokenizer, cached in the cascade cache
    (keyed by the corpora's texts and the tokenizer's vocabulary)."""
    from cascade.data import corpus  # the prompt sets' module: only needed when a corpus is named
    from cascade.models.zoo import cache_root

    texts = [t for name in names for t in corpus(name)]
    target.encode(texts[0])  # refuses a model that cannot tokenize text, before anything is built
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    tok = target.tokenizer  # the key must change when the tokenization does
    h.update(repr(("bytes", target.vocab_size) if tok is None else (len(tok), sorted(tok.get_vocab().items()))).encode())
    key = f"{'+'.join(names)}-{h.hexdigest()[:16]}"
    return Datastore.cached(key, lambda: [target.encode(t) for t in texts], cache_root() / "datastores")
