"""Stop policies: when an LM drafter ends a draft early.

A policy is asked after each drafted token (but the last one the budget allows) whether to
draft another, and is told each verification result. Any policy is lossless: the decision
depends only on the drafter's own tokens, probabilities, past verification results and
independent random draws, never on the target's verdict on the tokens being drafted.

    FixedK()                      always continue (the budget ``k`` is the only stop)
    ConfidenceStop(threshold)     stop when the drafter's top probability falls below the
                                  threshold (Kangaroo uses 0.6; transformers' assisted generation
                                  stops on the drafted token's probability, 0.4 by default)
    ThompsonStop(threshold)       Thompson-sampling control (Liu et al., ACL Findings 2024): keep a
                                  Beta(accepted + 1, rejected + 1) posterior on the drafter's
                                  per-token acceptance, draw theta, continue while theta >= threshold

Every decision is logged: ``policy.decisions`` (cleared when the drafter starts a draft) ends up
in the draft's ``stop`` field (``DraftBlock.stop``, then ``StepRecord.stop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StopPolicy:
    decisions: list[dict] = field(default_factory=list, init=False, repr=False)

    def reset(self, generator: torch.Generator | None) -> None:
        """New generation."""
        self.generator = generator
        self.decisions = []

    def start_draft(self) -> None:
        self.decisions = []

    def should_continue(self, position: int, probs: torch.Tensor) -> bool:
        """After drafting the token at ``position`` (0-based) from the drafter's unprocessed
        next-token distribution ``probs`` [V]: draft another token?"""
        return True

    def update(self, accepted: int, rejected: bool) -> None:
        """The last draft's verification: ``accepted`` tokens kept, then a rejection or not
        (``rejected`` False: every drafted token was kept)."""

    def state(self) -> dict:
        return {}


@dataclass
class FixedK(StopPolicy):
    """Draft the whole budget."""


@dataclass
class ConfidenceStop(StopPolicy):
    """Stop when the drafter's top next-token probability is below ``threshold``."""

    threshold: float = 0.6

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"confidence threshold must lie in [0, 1], got {self.threshold}")

    def should_continue(self, position: int, probs: torch.Tensor) -> bool:
        top = float(probs.max())
        go = top >= self.threshold
        self.decisions.append({"pos": position, "top_p": round(top, 4), "go": go})
        return go


@dataclass
class ThompsonStop(StopPolicy):
    """Thompson-sampling draft control with a Beta posterior on per-token acceptance.

    Verification observes ``accepted`` successes and, when the draft was cut short by a
    rejection, one failure; positions after the first rejection are never judged (censored) and
    are not counted. ``prior`` = (a, b) of the Beta prior (Beta(1, 1): uniform).
    """

    threshold: float = 0.5
    prior: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"Thompson threshold must lie in [0, 1], got {self.threshold}")
        a, b = self.prior
        if a <= 0 or b <= 0:
            raise ValueError(f"Beta prior parameters must be positive, got {self.prior}")
        self.reset(None)

    def reset(self, generator: torch.Generator | None) -> None:
        super().reset(generator)
        self.accepted, self.rejected = 0, 0
        # torch's Beta/Gamma samplers take no generator: seed a numpy generator once from the
        # run's, so theta draws are reproducible from the run's seed.
        seed = None if generator is None else int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        self._rng = np.random.default_rng(seed)

    def posterior(self) -> tuple[float, float]:
        return self.prior[0] + self.accepted, self.prior[1] + self.rejected

    def _draw(self) -> float:
        return float(self._rng.beta(*self.posterior()))

    def should_continue(self, position: int, probs: torch.Tensor) -> bool:
        theta = self._draw()
        go = theta >= self.threshold
        self.decisions.append({"pos": position, "theta": round(theta, 4), "go": go})
        return go

    def update(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += int(rejected)

    def state(self) -> dict:
        a, b = self.posterior()
        return {"accepted": self.accepted, "rejected": self.rejected, "posterior_mean": round(a / (a + b), 4)}


def make_stop_policy(stop: StopPolicy | None, stop_below: float | None) -> StopPolicy:
    """The policy a drafter uses: ``stop`` if given, else a confidence stop when ``stop_below``
    is set (the older shorthand), else fixed k."""
    if stop is not None and stop_below is not None:
        raise ValueError("give either stop (a policy) or stop_below (a confidence threshold), not both")
    if stop is not None:
        if not isinstance(stop, StopPolicy):
            raise TypeError(f"stop must be a StopPolicy, got {type(stop).__name__}")
        return stop
    if stop_below is not None:
        return ConfidenceStop(stop_below)
    return FixedK()
