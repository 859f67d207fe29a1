"""Typed run results: what ``summary.json`` holds, written and read back as the same types.

``metrics.summarize`` turns generations into :class:`RunStats`; ``cascade.evaluate`` adds, per
method, the speedup against the baseline, the in-sample :class:`Decomposition`, the held-out
:class:`HeldOut` prediction, per-category rows and greedy divergences (:class:`MethodSummary`);
``cascade.run`` writes the whole :class:`RunSummary` and ``cascade.results.Job`` reads it back
with :meth:`RunSummary.from_dict`. Every module reads these fields by attribute, never by string
key, so a renamed field is a failing import or attribute, not a silent ``None``. (The per-step
rows of ``steps.jsonl`` are another file: ``Job.steps()`` returns them as the dictionaries
``StepRecord.to_dict`` wrote, plus ``method`` and ``prompt``, read by those field names.)

Metric definitions (τ counts the bonus token, α per drafter, c per drafted token against the
verification forward, ...) are in ``cascade.metrics``' docstring.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field

from cascade.costs import ForwardShape
from cascade.types import DrafterInfo


@dataclass
class LevelSummary:
    """One level of a cascade over a run (``metrics`` docstring: ``levels``)."""

    drafted: int
    rounds: int  # inner rounds in which this level drafted (vertical cascades)
    alpha: float | None  # accepted by the level above it / drafted
    c: float | None  # its time per drafted token / target time per verification forward


@dataclass
class TreeDrafterSummary:
    """One drafter inside a tree drafter over a run (``metrics`` docstring: ``tree_by_drafter``)."""

    nodes_per_step: float  # tree nodes it proposed, per step
    accepted: float  # of those, the fraction on the accepted path
    c: float | None  # its time per proposed node / target time per verification forward


@dataclass
class RunStats:
    """Summary of a list of generations of one method (``cascade.metrics.summarize``)."""

    num_generations: int
    new_tokens: int
    target_forwards: int
    tau: float | None  # None: no step records (transformers' generate)
    alpha: float | None  # chains only; None for trees and for autoregressive decoding
    alpha_by_drafter: dict[str, float]
    c_by_drafter: dict[str, float]
    alpha_by_depth: list[float]
    drafted_per_step: float
    draft_time_per_token_s: float | None
    tokens_per_s: float
    wall_time_s: float
    prefill_time_s: float
    drafter_prefill_time_s: float
    target_time_per_forward_s: float | None
    draft_frac: float
    overhead_frac: float
    levels: dict[str, LevelSummary]
    tree_expected_tau: float | None = None
    tree_nodes_per_step: float | None = None
    tree_acceptance: float | None = None
    tree_drafter_forwards_per_step: float | None = None
    tree_by_drafter: dict[str, TreeDrafterSummary] = field(default_factory=dict)

    @property
    def c(self) -> float | None:
        """c of a single drafter (None for autoregressive decoding or several drafters)."""
        return next(iter(self.c_by_drafter.values())) if len(self.c_by_drafter) == 1 else None

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second of decoding alone: the wall time less the target's prefill and the
        drafter's catch-up on the prompt (a method without step records reports no prefill: its
        whole call counts)."""
        decode = self.wall_time_s - self.prefill_time_s - self.drafter_prefill_time_s
        return self.new_tokens / decode if decode > 0 else float("nan")


@dataclass
class Decomposition:
    """The closed forms at a run's own measurements (in-sample; ``metrics.decomposition``)."""

    formula_speedup: float | None = None
    formula_speedup_verify_cost: float | None = None
    formula_tau_iid: float | None = None
    decomposed_tau_per_depth: float | None = None
    decomposed_speedup_per_depth: float | None = None
    measured_over_formula: float | None = None


@dataclass
class HeldOut:
    """The second half of the prompts predicted from the first (``metrics.prediction``)."""

    fit_prompts: int
    test_prompts: int
    predicted_tau: float | None
    predicted_speedup: float | None
    predicted_speedup_formula: float | None
    measured_tau: float | None
    measured_speedup: float
    measured_over_predicted: float | None


@dataclass
class CategoryResult:
    """One prompt category of a run (``Prompt.category``), against the baseline on its prompts."""

    prompts: int
    tau: float | None
    tokens_per_s: float
    speedup: float


@dataclass
class Divergence:
    """Where a greedy method first left the baseline's tokens, and how near a tie the target's
    choice was there (batched and one-token numerics may round a near-tie differently)."""

    prompt: str
    position: int
    top2_gap: float | None  # None: not measured (the gap needs a forward of the target)


@dataclass
class MethodSummary:
    """One method of a run: what it is, its statistics, and how it compares with the baseline."""

    drafter: DrafterInfo
    stats: RunStats
    speedup: float  # tokens/s over the baseline's, same prompts, same process
    decomposition: Decomposition
    heldout: HeldOut | None  # None with fewer than two prompts
    by_category: dict[str, CategoryResult] | None  # None with one category
    tokens: dict[str, list[int]]  # prompt id -> generated token ids
    tokens_per_s_by_prompt: dict[str, float]
    identical_to_baseline: int | None = None  # greedy runs: prompts whose tokens equal the baseline's
    divergences: list[Divergence] = field(default_factory=list)
    decode_speedup: float | None = None  # decode-only tok/s over the baseline's (prefills excluded)

    @property
    def tau(self) -> float | None:
        return self.stats.tau

    @property
    def alpha(self) -> float | None:
        return self.stats.alpha

    @property
    def tokens_per_s(self) -> float:
        return self.stats.tokens_per_s


@dataclass
class Environment:
    torch: str
    transformers: str
    python: str
    device: str
    dtype: str
    threads: int
    git_commit: str | None
    cpu: str | None = None  # lscpu's model name (None off Linux)
    cpu_flags: list[str] = field(default_factory=list)  # the SIMD flags that decide kernel speed
    git_dirty: bool | None = None  # tracked files differed from git_commit when the run started
    git_diff_sha256: str | None = None  # a hash of that difference (`git diff HEAD`), when dirty
    cascade: str | None = None  # the package's version
    cpu_vendor: str | None = None
    cpu_family: int | None = None
    cpu_model: int | None = None
    cpu_stepping: int | None = None
    native_isa: dict[str, str] = field(default_factory=dict)  # the native kernels' instruction sets ({} when unavailable)
    native_unavailable: str | None = None  # why the native kernels are not used, when they are not
    target_kernels: dict[str, int] = field(default_factory=dict)  # the target's linear layers per kernel class
    backends: dict[str, str] = field(default_factory=dict)  # every model the run loaded -> its Backend's name
    peers: dict[str, str] = field(default_factory=dict)  # a method run by another program (llama.cpp) -> its version and build

    def header(self) -> str:
        """One line: the code, the CPU, the backends and kernels that made the numbers (the run
        table's first line; ``python -m cascade.results`` prints it per run)."""
        commit = (self.git_commit or "no commit")[:10] + (f" DIRTY (diff {self.git_diff_sha256})" if self.git_dirty else "")
        isa = ", ".join(f"{k} {v}" for k, v in self.native_isa.items()) or f"native unavailable: {self.native_unavailable}"
        kernels = ", ".join(f"{k} x{v}" for k, v in self.target_kernels.items())
        backends = ", ".join(f"{name} {b}" for name, b in self.backends.items())
        peers = "".join(f" | {name}: {info}" for name, info in self.peers.items())
        return (f"# commit {commit} | {self.cpu} (family {self.cpu_family} model {self.cpu_model}) | {self.threads} threads | "
                f"{isa} | backends: {backends} | target linears: {kernels} | torch {self.torch}{peers}")


@dataclass
class RunSummary:
    """Everything ``summary.json`` holds."""

    experiment: str
    config: dict  # the resolved Hydra config (free-form by nature: every group's own keys)
    environment: Environment
    baseline: str
    methods: dict[str, MethodSummary]
    clock: str = "measured"  # "measured", or "predicted:<device>": every time and speed in it is a roofline's prediction
    forward_shapes: dict[str, ForwardShape] = field(default_factory=dict)  # each model that ran (steps' forwards name them)

    # the config echo is free-form (each group has its own keys); these are the facts readers need
    @property
    def target(self) -> str:
        return self.config["models"]["target"]

    @property
    def small(self) -> str | None:
        return self.config["models"].get("small")

    @property
    def dataset(self) -> str:
        return self.config["dataset"]["name"]

    @property
    def num_prompts(self) -> int:
        return len(self.methods[self.baseline].tokens)

    @property
    def greedy(self) -> bool:
        return self.config["sampling"]["temperature"] == 0

    def speedup_range(self, name: str) -> tuple[float, float]:
        """(min, max) over prompts of method ``name``'s tok/s over the baseline's on the same prompt
        (the spread behind its speedup; the speedup itself twice when no prompt can be compared)."""
        base = self.methods[self.baseline].tokens_per_s_by_prompt
        mine = self.methods[name].tokens_per_s_by_prompt
        ratios = [mine[p] / base[p] for p in mine if base.get(p)]
        return (min(ratios), max(ratios)) if ratios else (self.methods[name].speedup,) * 2

    @property
    def compared(self) -> dict[str, MethodSummary]:
        """The methods other than the baseline."""
        return {n: m for n, m in self.methods.items() if n != self.baseline}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunSummary":
        """The summary a run wrote; raises ``TypeError`` / ``KeyError`` naming the field that is
        missing or of the wrong kind."""
        return from_dict(cls, data)


def from_dict(cls, data):
    """Rebuild a (nested) dataclass from what ``asdict`` wrote: fields typed as dataclasses,
    ``X | None``, ``list[X]`` and ``dict[str, X]`` are rebuilt recursively; other values are
    taken as they are."""
    hints = typing.get_type_hints(cls)
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{cls.__name__}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise KeyError(f"{cls.__name__}: missing field {f.name!r}")
    return cls(**kwargs)


def _convert(hint, value, where: str):
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value, where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v, where) for v in value]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object, got {type(value).__name__}")
        return {k: _convert(item, v, where) for k, v in value.items()}
    return value
