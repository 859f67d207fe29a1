"""Small-LM drafter: a smaller causal LM with its own KV cache.

The cache is kept in sync with the accepted prefix by token bookkeeping: the drafter remembers
which tokens its cache holds, and before drafting it crops the cache to the longest common
prefix with the context and feeds only the tokens it has not seen (typically the
recovered/bonus token, or the last draft token plus the bonus after a full acceptance).
"""

from __future__ import annotations

import torch

from cascade.drafters.base import Drafter
from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.types import DraftBlock, SamplingConfig


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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


class SmallLMDrafter(Drafter):
    """Drafts up to ``k`` tokens autoregressively with ``model``.

    sample: when the run samples (temperature > 0), sample draft tokens and report their exact
        ``q``; when False, always draft the argmax (``q=None``, one-hot) — also lossless.
    stop_below: optional confidence stop: end the draft after a token whose probability under
        the drafter (unprocessed softmax) is below this value.
    """

    def __init__(
        self,
        model: CausalLM,
        k: int = 4,
        sample: bool = True,
        stop_below: float | None = None,
        name: str | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if stop_below is not None and not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must lie in [0, 1], got {stop_below}")
        self.model, self.k, self.sample, self.stop_below = model, k, sample, stop_below
        self.name = name or f"small_lm({model.name})"
        self._compatible_with: set[int] = set()
        self.reset(SamplingConfig(), None)

    def check_compatible(self, target: CausalLM) -> None:
        if id(target) not in self._compatible_with:
            check_same_vocabulary(self.model, target)
            self._compatible_with.add(id(target))

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().reset(sampling, generator)
        self.cache = self.model.new_cache()
        self.cached: list[int] = []  # tokens whose keys/values the cache holds, in order

    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        """This model's logits after ``context`` and after each token of ``extra``, in one
        forward: [len(extra) + 1, V]. The cache is first cropped to its longest common prefix
        with ``context``; afterwards it holds ``context + extra``."""
        keep = min(common_prefix_len(self.cached, context), len(context) - 1)
        self.model.crop(self.cache, keep)
        new = context[keep:] + list(extra)
        self.cached = self.cached[:keep] + new
        return self.model.forward(new, self.cache, keep_last=len(extra) + 1)

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        n = min(budget, self.k)
        deterministic = self.sampling.greedy or not self.sample
        logits = self.score(context)[-1]  # [V]
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
            if self.stop_below is not None and i < n - 1:
                confidence = float(torch.softmax(logits.float(), -1)[token])
                if confidence < self.stop_below:
                    break
            if i < n - 1:
                logits = self.model.forward([token], self.cache)[-1]
                self.cached.append(token)
        q = torch.stack(qs) if qs else None  # [k, V]
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), q, self.name)
