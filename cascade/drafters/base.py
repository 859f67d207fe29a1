"""The drafter protocol.

A drafter proposes tokens (a chain, or a token tree) for the positions after a context; the
decode loop verifies them with the target. Its core is three methods, called per generation::

    drafter.start(DraftStart(target, cache, prompt, sampling, generator, hidden))
    loop:
        block = drafter.propose(context, budget)      # at most `budget` tokens deep
        ...the target verifies...
        drafter.observe(Outcome(context, result, verify_time_s, hidden, scored))

``start`` comes after the target's prefill (``cache`` holds ``prompt[:-1]``) and hands the run's
``SamplingConfig`` and generator: a drafter keeps them (``Drafter.start`` does) instead of having
them planted. ``context`` is the full token list (prompt + generated so far); ``Outcome`` says
what the target accepted. A deterministic drafter returns ``q=None``; one that samples returns
the exact distributions it sampled from.

What some drafters also do is a small capability of its own, which a caller detects by type:

* :class:`ChecksTarget`: ``check_compatible(target)`` before any generation with ``target``
  (refuse a vocabulary it cannot draft in; load what depends on the target). ``check_target``
  asks it of any drafter.
* :class:`SharesCache`: ``draft_cache()``, the model and KV cache it drafts on, which a
  self-drafting lower level of a vertical cascade shares.
* ``LMDrafter`` (``cascade.drafters.lm_base``): scores contexts with a model, so it can verify a
  cascade's lower level and feed a token tree level by level in one forward.

Declared data, not methods: ``hidden_layer`` (the target layer whose hidden states it wants in
``DraftStart.hidden`` and ``Outcome.hidden``; None: none), ``drafts_trees``, ``sample`` (whether
it samples when the run samples), ``k`` (most tokens per proposal, for summaries).

A self-drafting drafter (layer skip) works on the target's own cache: it may append draft-time
entries but must remove them before it returns, so the target always finds its cache as it left it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from cascade.models.lm import CausalLM, HiddenLayers
from cascade.types import DraftBlock, DrafterInfo, SamplingConfig, Scored, VerifyResult


@dataclass(frozen=True)
class DraftStart:
    """What a drafter is given when a generation starts (after the target's prefill)."""

    target: CausalLM  # the model it drafts for (a cascade's lower level: the level above's model)
    cache: object | None  # that model's KV cache holding prompt[:-1] (None: a lower level's model whose cache is not shared)
    prompt: list[int]
    sampling: SamplingConfig
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # [len(prompt) - 1, H] the target's states at ``hidden_layer`` (when asked for)

    def part(self, drafter: "Drafter") -> "DraftStart":
        """This start as a composite's part sees it: the hidden states only if it asked for them."""
        return self if drafter.hidden_layer is not None else replace(self, hidden=None)


@dataclass(frozen=True)
class Outcome:
    """What one verification decided, told to the drafter that proposed."""

    context: list[int]  # now ending with the accepted tokens and the recovered/bonus token
    result: VerifyResult
    verify_time_s: float | None = None  # the target forward's time (None: the verifier is a cascade level)
    hidden: torch.Tensor | None = None  # [m, H] the target's states at ``hidden_layer`` for the m positions committed
    scored: Scored | None = None  # the verifying forward's inputs and raw logits (read, never modified)

    def part(self, drafter: "Drafter") -> "Outcome":
        """This outcome as a composite's part sees it: the hidden states only if it asked for them."""
        return self if drafter.hidden_layer is not None else replace(self, hidden=None)


def shared_hidden_layer(drafters: list["Drafter"], what: str) -> HiddenLayers:
    """The one target layer (or tuple of layers) whose hidden states the ``drafters`` of a
    composite drafter need (None: none of them does); refuses drafters that need different ones.
    Asked when decoding starts (after ``check_target``: a head loaded then knows its layers)."""
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
    # Most tokens one proposal may hold (None: unbounded or not fixed), for run summaries.
    k: int | None = None

    _generation: DraftStart | None = None  # the generation in progress

    def start(self, run: DraftStart) -> None:
        """A new generation: drop per-generation state, keep the run's sampling settings, catch
        up on ``run.prompt`` (timed as the drafter's prefill)."""
        self._generation = run

    @property
    def sampling(self) -> SamplingConfig:
        """The generation's sampling settings (from ``start``)."""
        return self._started().sampling

    @property
    def generator(self) -> torch.Generator | None:
        """The generation's source of randomness (from ``start``)."""
        return self._started().generator

    def _started(self) -> DraftStart:
        if self._generation is None:
            raise RuntimeError(f"{self.name}: not started (start(DraftStart(...)) comes first; cascade.generate calls it)")
        return self._generation

    @abstractmethod
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        """Propose at most ``budget`` (>= 1) tokens deep following ``context``."""

    def observe(self, outcome: Outcome) -> None:
        """Told what the target accepted of the last proposal (``Outcome``)."""

    def describe(self) -> DrafterInfo:
        """Kind, draft budget and the drafters inside, for run summaries."""
        return DrafterInfo(kind=self.kind, name=self.name, budget=self.k)


class ChecksTarget(ABC):
    """A drafter that must see the target before drafting for it."""

    @abstractmethod
    def check_compatible(self, target: CausalLM) -> None:
        """Raise ValueError when this drafter cannot draft for ``target`` (e.g. vocabulary);
        prepare what depends on it. Called before any generation with ``target``."""


def check_target(drafter: Drafter, target: CausalLM) -> None:
    """Let ``drafter`` refuse or prepare for ``target`` (a no-op for one that need not see it)."""
    if isinstance(drafter, ChecksTarget):
        drafter.check_compatible(target)


class SharesCache(ABC):
    """A drafter with a model and KV cache of its own that a lower cascade level may draft on."""

    @abstractmethod
    def draft_cache(self) -> tuple[CausalLM, object] | None:
        """The model and KV cache this drafter drafts on (None before its first ``start``)."""
