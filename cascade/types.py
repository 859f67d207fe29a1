"""Typed records passed between the stages of a decoding step.

Data flows one way: a drafter proposes a :class:`DraftBlock` (a chain, or a token tree), the
verifier (``cascade.verify``) turns the target's distributions into a :class:`VerifyResult`, and
the decode loop records a :class:`StepRecord`. What a cascade or a tree drafter reports about
its own work travels in typed fields (:class:`CascadeStats`, :class:`Segment`,
:class:`TreeStats`), never in free-form dictionaries read by another module. Shapes are given in
comments; ``V`` is the vocabulary size and ``n`` the number of drafted nodes in the step (``k``
for a chain).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from cascade.tree_structure import chain_parents, depths_of, is_chain


@dataclass(frozen=True)
class SamplingConfig:
    """How token distributions are processed before sampling, for target and drafter alike.

    ``temperature == 0`` means greedy decoding (argmax); ``top_k``/``top_p`` are then ignored.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # an int from a command line (temperature=2) is the number it names; transformers' warpers
        # want floats, so it is stored as one
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        t = self.temperature
        if not isinstance(t, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class LevelStats:
    """Work of one drafting level of a cascade, summed over the rounds of a step (or a run)."""

    drafted: int = 0  # tokens it proposed
    accepted: int = 0  # of those, kept by the level above it
    time_s: float = 0.0  # its own time (a nested cascade: its top model's time only)
    rounds: int = 0  # inner rounds in which it drafted

    def add(self, other: "LevelStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.time_s += other.time_s
        self.rounds += other.rounds


@dataclass
class CascadeStats:
    """What a vertical cascade reports about a draft: its top level (judged by the target) and
    every lower level (judged by the level above it), by drafter name."""

    top: str  # name of the top level
    top_time_s: float  # the top level's own time in this draft
    lower: dict[str, LevelStats] = field(default_factory=dict)


@dataclass
class Segment:
    """Where one entry of a horizontal schedule put its tokens in a draft."""

    drafter: str
    start: int  # first draft position it filled
    length: int  # positions it filled
    time_s: float


@dataclass
class AlphaEstimate:
    """One acceptance estimate α̂ of a dynamic tree policy (``cascade.estimators.Acceptance``)."""

    mean: float  # posterior mean
    ema: float | None  # recent-rate EMA (None before the first observation)
    n: int  # judged observations


@dataclass
class PolicyEstimates:
    """What a tree policy acted on at one step (logged per step in ``TreeStats``)."""

    alpha: dict[str, dict[str, AlphaEstimate]] = field(default_factory=dict)  # drafter -> key ("depth1", "rank2", "conf3", "sibling_conf3") -> α̂
    drafter_cost_s: dict[str, float] = field(default_factory=dict)  # forward-free drafter -> seconds per proposal
    forward_curve_s: dict[str, dict[int, float]] = field(default_factory=dict)  # LM drafter -> width -> seconds
    verify_curve_s: dict[int, float] | None = None  # the target's forward: input count -> seconds
    realised: dict[str, float | None] = field(default_factory=dict)  # DyTC's realised-outcome check: tokens/s per drafting mode


@dataclass
class TreeStats:
    """What a tree drafter reports about the tree it grew."""

    node_drafters: list[str]  # [n] the drafter that proposed each node
    expected_accepted: float  # the policy's own expectation of accepted nodes (sum of path reaches)
    drafter_forwards: int = 0  # LM drafter forwards spent growing it (at most one per depth and drafter)
    drafter_seconds: dict[str, float] = field(default_factory=dict)  # time of each drafter's calls growing it
    estimates: PolicyEstimates = field(default_factory=PolicyEstimates)  # the policy's α̂ / cost estimates
    node_ranks: list[int] = field(default_factory=list)  # [n] 1: its drafter's first child of its parent; r: the r-th
    node_alpha: list[float] = field(default_factory=list)  # [n] the policy's α̂ of the node given its parent is accepted
    shape: str = "tree"  # what the policy chose to verify: "tree", or "chain" (its guard or its realised-outcome check)


@dataclass
class DraftBlock:
    """Tokens a drafter proposes below the last committed token: a chain or a token tree.

    ``parents[i]`` is node i's parent (-1: a child of the last committed token; parents before
    children; see ``cascade.tree_structure``); a chain has ``[-1, 0, 1, ...]``, the default. ``q`` holds,
    row by row, the distribution each token was *actually* sampled from (after the run's
    temperature/top-k/top-p). ``q is None`` means every token was chosen deterministically
    (argmax, n-gram lookup): the verifier then treats each row as one-hot on the drafted token,
    which is what keeps deterministic drafting lossless.
    """

    tokens: torch.Tensor  # [n] int64, on the target's device or CPU
    q: torch.Tensor | None = None  # [n, V] float probabilities, or None (deterministic)
    drafter: str = ""  # name of the drafter that proposed the block
    parents: list[int] | None = None  # [n]; None is read as a chain
    stop: list[dict] = field(default_factory=list)  # an LM drafter's stop-policy decisions
    cascade: CascadeStats | None = None  # a vertical cascade's per-level work
    segments: list[Segment] = field(default_factory=list)  # a horizontal schedule's spans
    tree: TreeStats | None = None  # a tree drafter's statistics

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"DraftBlock.tokens must be 1-D [n], got shape {tuple(self.tokens.shape)}")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != self.tokens.shape[0]):
            raise ValueError(
                f"DraftBlock.q must be [n, V] with n={self.tokens.shape[0]}, got {tuple(self.q.shape)}"
            )
        if self.parents is None:
            self.parents = chain_parents(int(self.tokens.shape[0]))
        elif len(self.parents) != self.tokens.shape[0]:
            raise ValueError(f"DraftBlock.parents has {len(self.parents)} entries for {self.tokens.shape[0]} tokens")

    @property
    def k(self) -> int:
        """Number of drafted nodes (the draft length, for a chain)."""
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    @property
    def depth(self) -> int:
        """Length of the longest drafted path (k for a chain)."""
        return self.k if self.is_chain else max(depths_of(self.parents), default=0)

    @staticmethod
    def empty(drafter: str = "") -> "DraftBlock":
        return DraftBlock(tokens=torch.empty(0, dtype=torch.long), q=None, drafter=drafter)


ACCEPTED, REJECTED, UNJUDGED = 1, 0, -1


@dataclass
class Scored:
    """What the verifying model computed in one step: the inputs it was fed (the last committed
    token, then the draft's nodes in order) and its raw logits after each. Handed to
    ``Drafter.observe`` so a drafter can learn from a forward that was run anyway (Token
    Recycling's table) without running one of its own. In a cascade's inner round the verifying
    model is the level above, not the target."""

    inputs: list[int]  # [n + 1]
    logits: torch.Tensor  # [n + 1, V] raw, unprocessed; read-only for drafters


@dataclass
class Retokenization:
    """What a cross-tokenizer drafter's change of vocabulary cost, summed over its proposals in
    the process (``cascade.drafters.cross_tokenizer``)."""

    drafts: int = 0  # chain proposals
    drafted: int = 0  # string-level match: drafter tokens drafted; intersection: target tokens
    proposed: int = 0  # target tokens proposed
    drafted_bytes: int = 0  # string-level match: bytes of the drafted text
    proposed_bytes: int = 0  # ... of those, carried into proposed target tokens
    shared_mass: float = 0.0  # intersection: the drafter's probability on shared tokens, summed over drafted rows
    shared_rows: int = 0

    @property
    def lost_bytes_frac(self) -> float | None:
        """String-level match: the fraction of drafted text re-tokenization did not propose (an
        incomplete character at the end, tokens past the budget, a draft that merged into the
        context's last token)."""
        return 1.0 - self.proposed_bytes / self.drafted_bytes if self.drafted_bytes else None

    @property
    def mean_shared_mass(self) -> float | None:
        """Intersection: the drafter's mean probability on the tokens it may draft."""
        return self.shared_mass / self.shared_rows if self.shared_rows else None


@dataclass
class DrafterInfo:
    """What a method is, written into every run summary (analysis reads it instead of guessing
    from config keys or class names)."""

    kind: str  # e.g. "small_lm", "ngram", "kangaroo", "vertical_cascade", "static_tree", "dytc_tree"
    name: str
    budget: int | None  # most drafted nodes per step (chain: k; a cascade level: per inner round)
    stop: str | None = None  # an LM drafter's stop policy ("FixedK", "ConfidenceStop", ...)
    parts: list["DrafterInfo"] = field(default_factory=list)  # the drafters it is built from, in order
    retokenization: Retokenization | None = None  # a cross-tokenizer drafter's

    @property
    def chain(self) -> bool:
        """A single drafter proposing chains (what trace replay and EWIF curves need)."""
        return not self.parts

    @property
    def drafters(self) -> list[str]:
        """Names of the single drafters inside (itself, for a single drafter)."""
        return [n for p in self.parts for n in p.drafters] if self.parts else [self.name]


@dataclass
class VerifyResult:
    """Outcome of verifying one draft block against the target.

    ``path`` holds the accepted nodes from the root down (a chain: ``0 .. num_accepted - 1``);
    ``next_token`` is the recovered token (drawn from the residual at the first node whose
    children were all rejected) or, below a leaf, the bonus token drawn from the target's
    distribution there. ``judgements`` says, per node, whether the verifier accepted, rejected
    or never reached it (what acceptance estimators learn from).
    """

    num_accepted: int
    next_token: int
    all_accepted: bool  # True: next_token is the bonus token (the path ends at a leaf)
    path: list[int] = field(default_factory=list)  # accepted node indices, root's child first
    judgements: list[int] = field(default_factory=list)  # [n] ACCEPTED, REJECTED or UNJUDGED

    @property
    def emitted(self) -> int:
        return self.num_accepted + 1


@dataclass
class ForwardCall:
    """One model forward inside a decoding step (what a roofline prices: ``cascade.costs``)."""

    model: str  # the model's (or draft head's) name; its shape is in the run summary's ``forward_shapes``
    inputs: int
    context: int  # cached positions it attended to


@dataclass
class StepRecord:
    """One decoding step (one target forward). Times are wall-clock seconds.

    ``emitted`` may be smaller than ``accepted + 1`` when EOS or ``max_new_tokens`` cut the
    step short. ``target_argmax`` is the target's argmax at the root and at each drafted node
    (``n + 1`` entries): with ``draft_tokens`` and ``parents`` it lets a trace be replayed offline.
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
    parents: list[int] = field(default_factory=list)  # [n] the draft's shape (a chain: -1, 0, 1, ...)
    accepted_path: list[int] = field(default_factory=list)  # accepted node indices
    stop: list[dict] = field(default_factory=list)
    cascade: CascadeStats | None = None
    segments: list[Segment] = field(default_factory=list)
    tree: TreeStats | None = None
    accept_time_s: float = 0.0  # the acceptance rule's own time (step 3: p from the logits, judging, the draw)
    forwards: list[ForwardCall] = field(default_factory=list)  # every model forward of the step, in order

    @property
    def overhead_time_s(self) -> float:
        """Time of the step spent outside drafter and target forwards (verification, bookkeeping)."""
        return max(0.0, self.step_time_s - self.draft_time_s - self.target_time_s)

    def to_dict(self) -> dict:
        """One JSON line of ``steps.jsonl``."""
        row = asdict(self)
        row["overhead_time_s"] = self.overhead_time_s
        return row
