"""Token ids as byte strings, and the bridge between two vocabularies (cross-tokenizer drafting).

A drafter from another model family sees the committed text, not the target's ids. Both sides
are byte-level BPE vocabularies here (GPT-2 style, as Qwen2, SmolLM2, Llama-3 use): every id is
a byte string, and every byte string has an encoding, so text moves between vocabularies
without loss:

* :class:`ByteVocabulary`: one model's ids <-> bytes. ``bytes_of(ids)`` concatenates the ids'
  bytes (an added/special token: its content); ``encode(data)`` tokenizes bytes (runs that are
  not valid UTF-8 become single-byte tokens, which every byte-level vocabulary holds). A model
  without a tokenizer (the tiny test models) uses its ids 0..255 as the bytes themselves, the
  convention of ``CausalLM.encode``.
* :class:`VocabularyBridge`: a drafter's vocabulary against a target's. The **intersection**
  holds the tokens that are the same byte string in both (special tokens only with a special
  token of the same content); ``target_logits`` maps drafter logits onto the target's
  vocabulary, -inf outside the intersection (the token-level intersection rule's distribution
  before processing); ``drafter_context`` and ``drafter_piece`` re-encode target ids for the
  drafter; ``target_continuation`` re-tokenizes drafted text into target ids after a context
  (the string-level rule's proposal).

Pure bookkeeping: no models are run here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def _utf8_length(lead: int) -> int:
    """Bytes of the UTF-8 character that starts with byte ``lead`` (1 for a byte no character starts with)."""
    for length, prefix, shift in ((2, 0b110, 5), (3, 0b1110, 4), (4, 0b11110, 3)):
        if lead >> shift == prefix:
            return length
    return 1


def complete_utf8_prefix(data: bytes) -> bytes:
    """``data`` without a trailing incomplete UTF-8 character (a byte-level draft may stop
    inside one; the rest of that character is not drafted yet)."""
    for cut in range(1, min(4, len(data)) + 1):
        if data[-cut] & 0xC0 != 0x80:  # the last character's first byte
            return data if _utf8_length(data[-cut]) <= cut else data[:-cut]
    return data


@dataclass
class ByteVocabulary:
    """One model's vocabulary as byte strings.

    token_bytes: [V] each id's bytes (b"" for ids the tokenizer does not define).
    special: ids of added/special tokens (their bytes are their content).
    """

    name: str
    token_bytes: list[bytes]
    special: set[int]
    tokenizer: object | None  # a transformers tokenizer, or None: ids 0..255 are the bytes
    byte_ids: dict[int, int] = field(init=False)  # byte -> its single-byte token

    def __post_init__(self) -> None:
        self.byte_ids = {}
        for i, b in enumerate(self.token_bytes):
            if len(b) == 1 and i not in self.special:
                self.byte_ids.setdefault(b[0], i)

    def byte_token(self, byte: int) -> int:
        token = self.byte_ids.get(byte)
        if token is None:
            raise ValueError(f"{self.name} has no token for byte {byte:#04x}: it cannot encode this text")
        return token

    @classmethod
    def of_model(cls, lm) -> "ByteVocabulary":
        """The vocabulary of a ``CausalLM`` (its tokenizer, or byte ids when it has none)."""
        size = lm.vocab_size
        if lm.tokenizer is None:
            if size < 256:
                raise ValueError(f"model {lm.name!r} has no tokenizer and {size} < 256 ids: its ids are not bytes")
            return cls(lm.name, [bytes([i]) for i in range(256)] + [b""] * (size - 256), set(), None)
        return cls.of_tokenizer(lm.tokenizer, size, lm.name)

    @classmethod
    def of_tokenizer(cls, tokenizer, size: int | None = None, name: str = "tokenizer") -> "ByteVocabulary":
        """Refuses a tokenizer that is not byte-level BPE (a token string outside GPT-2's byte
        alphabet: SentencePiece's '▁' pieces, WordPiece's '##'): its ids have no exact bytes."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        kind = json.loads(backend.to_str())["model"]["type"] if backend is not None else type(tokenizer).__name__
        if kind != "BPE":
            raise ValueError(f"{name}: a {kind} tokenizer is not byte-level BPE: cascade's cross-tokenizer drafting "
                             "needs byte-level vocabularies on both sides")
        decoder = _byte_decoder()
        vocab = tokenizer.get_vocab()
        size = max(size or 0, max(vocab.values()) + 1)
        added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        token_bytes = [b""] * size
        foreign = []
        for text, i in vocab.items():
            if i in added:
                token_bytes[i] = added[i].encode("utf-8")
            elif all(ch in decoder for ch in text):
                token_bytes[i] = bytes(decoder[ch] for ch in text)
            else:
                foreign.append(text)
        if foreign:
            raise ValueError(
                f"{name}: {len(foreign)} tokens (e.g. {foreign[:3]}) are not byte-level BPE strings: cascade's "
                "cross-tokenizer drafting needs byte-level vocabularies on both sides"
            )
        return cls(name, token_bytes, set(added), tokenizer)

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def bytes_of(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    def key(self, i: int) -> tuple[bool, bytes]:
        """What must match for two vocabularies' tokens to be the same token."""
        return (i in self.special, self.token_bytes[i])

    def encode(self, data: bytes) -> list[int]:
        """Token ids of ``data``: valid UTF-8 runs through the tokenizer (special-token text
        becomes the special token), any other byte as its single-byte token."""
        if self.tokenizer is None:
            return list(data)
        ids: list[int] = []
        rest = data
        while rest:
            try:
                text, bad, rest = rest.decode("utf-8"), b"", b""
            except UnicodeDecodeError as err:
                text, bad, rest = rest[: err.start].decode("utf-8"), rest[err.start: err.end], rest[err.end:]
            if text:
                ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += [self.byte_token(b) for b in bad]
        return ids


class VocabularyBridge:
    """A drafter's vocabulary against the vocabulary of the model it drafts for.

    shared: the intersection as aligned id tensors ``target_ids`` / ``drafter_ids`` [S].
    """

    def __init__(self, target: ByteVocabulary, drafter: ByteVocabulary, window: int = 4) -> None:
        self.target, self.drafter, self.window = target, drafter, window
        by_key = {target.key(i): i for i in range(target.size) if target.token_bytes[i]}
        pairs = sorted((by_key[drafter.key(d)], d) for d in range(drafter.size)
                       if drafter.token_bytes[d] and drafter.key(d) in by_key)
        if not pairs:
            raise ValueError(f"{drafter.name} and {target.name} share no token: nothing to draft")
        self.target_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)  # [S]
        self.drafter_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)  # [S]
        self.drafter_of_target = dict(pairs)  # shared target id -> drafter id
        self._filler = next(iter(drafter.byte_ids.values()), 0)  # the piece of a target id without bytes
        self._last_context: tuple[list[int], list[int]] | None = None  # (target ids, their drafter tokens)

    @property
    def shared(self) -> int:
        return int(self.target_ids.numel())

    def target_logits(self, drafter_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] drafter logits -> [..., Vt] over the target's vocabulary: a shared token's
        logit, -inf elsewhere. Softmax of it is the drafter's distribution restricted to the
        intersection and renormalised."""
        out = drafter_logits.new_full((*drafter_logits.shape[:-1], self.target.size), float("-inf"))
        out[..., self.target_ids.to(out.device)] = drafter_logits[..., self.drafter_ids.to(out.device)]
        return out

    def shared_mass(self, drafter_logits: torch.Tensor) -> torch.Tensor:
        """[...] the drafter's (unprocessed) probability on the intersection."""
        probs = torch.softmax(drafter_logits.float(), -1)
        return probs[..., self.drafter_ids.to(probs.device)].sum(-1)

    def drafter_context(self, target_ids: list[int]) -> list[int]:
        """The drafter's tokens for the text of ``target_ids`` (re-tokenized as a whole; the last
        context's result is kept, since a cascade's top level syncs and then scores the same
        context). The returned list is shared: callers must not modify it."""
        if self._last_context is None or self._last_context[0] != target_ids:
            self._last_context = (list(target_ids), self.drafter.encode(self.target.bytes_of(target_ids)))
        return self._last_context[1]

    def drafter_piece(self, target_id: int) -> list[int]:
        """The drafter's tokens for one target token appended to a draft: the shared token, or
        its bytes encoded alone. A function of the token only, so a drafter fed token by token
        conditions each position on the draft's past alone."""
        shared = self.drafter_of_target.get(target_id)
        if shared is not None:
            return [shared]
        return self.drafter.encode(self.target.token_bytes[target_id]) or [self._filler]

    def target_continuation(self, context: list[int], data: bytes) -> list[int]:
        """Target ids for drafted bytes ``data`` following ``context``: the last ``window``
        context tokens and ``data`` are tokenized together, and what follows those tokens is the
        continuation; where the draft's text merges into the context's last token (the
        tokenization no longer starts with the context's tail), ``data`` is tokenized alone."""
        if not data:
            return []
        tail = context[-self.window:]
        ids = self.target.encode(self.target.bytes_of(tail) + data)
        if ids[: len(tail)] == tail:
            return ids[len(tail):]
        return self.target.encode(data)
