"""Typed records passed between the stages of a decoding step.

Data flows one way: a drafter proposes a :class:`DraftBlock`, the verifier turns the
target's distributions into a :class:`VerifyResult`, and the decode loop records a
:class:`StepRecord`. Shapes are given in comments; ``V`` is the vocabulary size and
``k`` the number of drafted tokens in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How token distributions are processed before sampling, for target and drafter alike.

    ``temperature == 0`` means greedy decoding (argmax); ``top_k``/``top_p`` are then ignored.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DraftBlock:
    """Tokens a drafter proposes for the positions right after the context.

    ``q`` holds, row by row, the distribution each token was *actually* sampled from (after
    the run's temperature/top-k/top-p). ``q is None`` means the tokens were chosen
    deterministically (argmax, n-gram lookup): the verifier then treats each ``q`` row as
    one-hot on the drafted token, which is what keeps deterministic drafting lossless.
    """

    tokens: torch.Tensor  # [k] int64, on the target's device or CPU
    q: torch.Tensor | None = None  # [k, V] float probabilities, or None (deterministic)
    drafter: str = ""  # name of the drafter that proposed the block
    # Anything a drafter wants logged with the step (e.g. stop decisions); JSON-serialisable.
    info: dict = field(default_factory=dict)
    # A token tree instead of a chain: parents[i] is the index of node i's parent (-1: a child of
    # the last committed token), parents before children; see cascade.tree. None: a chain.
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"DraftBlock.tokens must be 1-D [k], got shape {tuple(self.tokens.shape)}")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != self.tokens.shape[0]):
            raise ValueError(
                f"DraftBlock.q must be [k, V] with k={self.tokens.shape[0]}, got {tuple(self.q.shape)}"
            )
        if self.parents is not None and len(self.parents) != self.tokens.shape[0]:
            raise ValueError(f"DraftBlock.parents has {len(self.parents)} entries for {self.tokens.shape[0]} tokens")

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """Length of the longest drafted path (k for a chain)."""
        if self.parents is None:
            return self.k
        from cascade.tree import depths_of

        return max(depths_of(self.parents), default=0)

    @staticmethod
    def empty(drafter: str = "") -> "DraftBlock":
        return DraftBlock(tokens=torch.empty(0, dtype=torch.long), q=None, drafter=drafter)


@dataclass
class VerifyResult:
    """Outcome of verifying one draft block against the target.

    ``num_accepted`` draft tokens are kept; ``next_token`` is the recovered token (sampled from
    ``norm(max(0, p - q))`` at the first rejection) or, when every draft token was kept, the
    bonus token sampled from the target's distribution after the last one.
    """

    num_accepted: int
    next_token: int
    all_accepted: bool  # True: next_token is the bonus token; False: it is the recovered token

    @property
    def emitted(self) -> int:
        return self.num_accepted + 1


@dataclass
class StepRecord:
    """One decoding step (one target forward). Times are wall-clock seconds.

    ``emitted`` may be smaller than ``accepted + 1`` when EOS or ``max_new_tokens`` cut the
    step short. ``target_argmax`` is the target's argmax at each drafted position and the one
    after (``k + 1`` entries): with ``draft_tokens`` it lets a trace be replayed offline.
    """

    step: int
    drafter: str
    drafted: int
    accepted: int
    emitted: int
    draft_tokens: list[int]
    emitted_tokens: list[int]
    target_argmax: list[int]
    draft_time_s: float
    target_time_s: float
    step_time_s: float
    info: dict = field(default_factory=dict)

    @property
    def overhead_time_s(self) -> float:
        """Time of the step spent outside drafter and target forwards (verification, bookkeeping)."""
        return max(0.0, self.step_time_s - self.draft_time_s - self.target_time_s)

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "drafter": self.drafter,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "draft_tokens": self.draft_tokens,
            "emitted_tokens": self.emitted_tokens,
            "target_argmax": self.target_argmax,
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "step_time_s": self.step_time_s,
            "overhead_time_s": self.overhead_time_s,
            "info": self.info,
        }
