"""The drafter protocol.

A drafter proposes tokens (a chain, or a token tree) for the positions after a context; the
decode loop verifies them with the target. Lifecycle per generation::

    drafter.check_compatible(target)       # refuses a drafter whose vocabulary differs
    drafter.bind(target, cache)            # the target's KV cache for this generation
    drafter.reset(sampling, generator)     # new generation: drop state, take the run's settings
    drafter.prefill(prompt, hidden)        # catch up on the prompt (timed beside the target's prefill)
    loop:
        block = drafter.propose(context, budget)   # at most `budget` tokens deep
        ...target verifies...
        drafter.observe(context_after, result, verify_time_s, hidden, scored)   # what the target accepted

``context`` is the full token list (prompt + generated so far). A drafter with a KV cache keeps
it in sync with the accepted prefix (see ``SmallLMDrafter``). A self-drafting drafter (layer
skip) works on the target's own cache, given by ``bind``: it may append draft-time entries but
must remove them before it returns, so the target always finds its cache as it left it. A
drafter that needs the target's hidden states after some layer (Kangaroo's adapter) names that
layer in ``hidden_layer``; the loop then hands it those states for the prompt (``prefill``) and
for the positions each step commits (``observe``). A deterministic drafter returns ``q=None``;
one that samples returns the exact distributions it sampled from, processed with the run's
``SamplingConfig``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cascade.models.lm import CausalLM, HiddenLayers
from cascade.types import DraftBlock, DrafterInfo, SamplingConfig, Scored, VerifyResult


def shared_hidden_layer(drafters: list["Drafter"], what: str) -> HiddenLayers:
    """The one target layer (or tuple of layers) whose hidden states the ``drafters`` of a
    composite drafter need (None: none of them does); refuses drafters that need different ones.
    Asked when decoding starts (after ``check_compatible``: a head loaded then knows its layers)."""
    layers = {d.hidden_layer for d in drafters} - {None}
    if len(layers) > 1:
        raise ValueError(f"{what} need the target's hidden states at different layers {sorted(map(str, layers))}")
    return layers.pop() if layers else None


class Drafter(ABC):
    name: str = "drafter"
    kind: str = "drafter"  # what kind of method this is, written into run summaries

    # The target layer whose output hidden states this drafter needs (None: none).
    hidden_layer: HiddenLayers = None
    # Whether its drafts may be token trees (else always chains): a chain-only verification
    # rule (block verification) refuses such a drafter before decoding.
    drafts_trees: bool = False
    # Whether it samples its drafts when the run samples (False: argmax drafts, deterministic,
    # q one-hot); a tree policy reads it to rank or draw a drafter's children.
    sample: bool = True

    def check_compatible(self, target: CausalLM) -> None:
        """Raise ValueError when this drafter cannot draft for ``target`` (e.g. vocabulary)."""

    def bind(self, target: CausalLM, cache) -> None:
        """Told the target and its KV cache (holding the committed prefix) at the start of a
        generation. Drafters that share the target's weights and cache keep them; others ignore it."""

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Start a new generation."""
        self.sampling = sampling
        self.generator = generator

    def prefill(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        """Catch up on the prompt before the first proposal (an LM drafter fills its cache).
        ``hidden``: [len(prompt) - 1, H] the target's states at ``hidden_layer`` (when asked for)."""

    @abstractmethod
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        """Propose at most ``budget`` (>= 1) tokens deep following ``context``."""

    def observe(self, context: list[int], result: VerifyResult, verify_time_s: float | None = None,
                hidden: torch.Tensor | None = None, scored: Scored | None = None) -> None:
        """Told the verification result; ``context`` now ends with the accepted tokens and the
        recovered/bonus token. ``verify_time_s``: the target forward's time (None when the
        verifier is a cascade level). ``hidden``: [m, H] the target's states at ``hidden_layer``
        for the m positions this step committed (the last root and the accepted path).
        ``scored``: the verifying forward's inputs and raw logits (``Scored``); a drafter that
        learns from them must not modify them."""

    def draft_cache(self) -> tuple[CausalLM, object] | None:
        """The model and KV cache this drafter drafts on, which a self-drafting lower level of a
        cascade (a layer skip of that model) shares; None for a drafter without a model."""
        return None

    @property
    def budget(self) -> int | None:
        """Most tokens one proposal may hold (None: unbounded or not fixed)."""
        return getattr(self, "k", None)

    def describe(self) -> DrafterInfo:
        """Kind, draft budget and the drafters inside, for run summaries."""
        return DrafterInfo(kind=self.kind, name=self.name, budget=self.budget)
