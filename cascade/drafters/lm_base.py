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
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from cascade.drafters.base import Drafter
from cascade.drafters.stopping import FixedK, StopPolicy, make_stop_policy
from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.types import DraftBlock, DrafterInfo, SamplingConfig, VerifyResult


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


class LMDrafter(Drafter):
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

    def check_compatible(self, target: CausalLM) -> None:
        if id(target) not in self._compatible_with:
            check_same_vocabulary(self.model, target)
            self._compatible_with.add(id(target))

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().reset(sampling, generator)
        self.stop.reset(generator)

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

    def describe(self) -> DrafterInfo:
        return DrafterInfo(kind=self.kind, name=self.name, budget=self.k, stop=type(self.stop).__name__)

    def prefill(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        """Run the model over all but the last prompt token, so that the first proposal feeds
        only that one (a drafter on the target's own cache overrides this: nothing to catch up)."""
        if len(prompt) > 1:
            self.score(prompt[:-1])

    def sync(self, context: list[int]) -> int:
        """Make the KV cache of ``self.model`` hold a prefix of ``context`` (nothing else); return
        its length. Called by a vertical cascade before the level below (which may share that
        cache) drafts."""
        return 0

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        n = min(budget, self.k)
        deterministic = self.sampling.greedy or not self.sample
        self.stop.start_draft()
        logits = self._start_draft(context)  # [V]
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
            logits = self._continue(token)
        self._end_draft()
        q = torch.stack(qs) if qs else None  # [k, V]
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), q, self.name, stop=list(self.stop.decisions))

    def observe(self, context: list[int], result: VerifyResult, verify_time_s: float | None = None,
                hidden: torch.Tensor | None = None) -> None:
        self.stop.update(result.num_accepted, not result.all_accepted)
