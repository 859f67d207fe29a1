"""The drafter protocol.

A drafter proposes tokens for the positions after a context; the decode loop verifies them with
the target. Lifecycle per generation::

    drafter.check_compatible(target)       # refuses a drafter whose vocabulary differs
    drafter.bind(target, cache)            # the target's KV cache for this generation
    drafter.reset(sampling, generator)     # new generation: drop state, take the run's settings
    loop:
        block = drafter.propose(context, budget)   # at most `budget` tokens
        ...target verifies...
        drafter.observe(context_after, result)     # what the target accepted

``context`` is the full token list (prompt + generated so far). A drafter with a KV cache keeps
it in sync with the accepted prefix (see ``SmallLMDrafter``). A self-drafting drafter (layer
skip) works on the target's own cache, given by ``bind``: it may append draft-time entries but
must remove them before it returns, so the target always finds its cache as it left it. A deterministic drafter returns
``q=None``; one that samples returns the exact distributions it sampled from, processed with
the run's ``SamplingConfig``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cascade.models.lm import CausalLM
from cascade.types import DraftBlock, SamplingConfig, VerifyResult


class Drafter(ABC):
    name: str = "drafter"

    def check_compatible(self, target: CausalLM) -> None:
        """Raise ValueError when this drafter cannot draft for ``target`` (e.g. vocabulary)."""

    def bind(self, target: CausalLM, cache) -> None:
        """Told the target and its KV cache (holding the committed prefix) at the start of a
        generation. Drafters that share the target's weights and cache keep them; others ignore it."""

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Start a new generation."""
        self.sampling = sampling
        self.generator = generator

    @abstractmethod
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        """Propose at most ``budget`` (>= 1) tokens following ``context``."""

    def observe(self, context: list[int], result: VerifyResult) -> None:
        """Told the verification result; ``context`` now ends with the accepted tokens and the
        recovered/bonus token."""
