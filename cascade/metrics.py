"""Per-step records -> run summaries, and the JSONL writer.

Definitions (summed over all steps of all generations in a run, never averaged per sample):

``tau``
    tokens emitted per target forward; the recovered-or-bonus token is counted, so plain
    autoregressive decoding has ``tau == 1``.
``alpha``
    accepted draft tokens / drafted tokens, overall and per drafter (``alpha_by_drafter``).
``c``
    drafter time per drafted token / target time per verification forward, per drafter.
    Drafter time includes its catch-up forwards on tokens it had not seen.
``tokens_per_s``
    new tokens / total wall time (the target's and the drafter's prefill included; both are
    also reported on their own: ``prefill_time_s``, ``drafter_prefill_time_s``).
``overhead_frac``
    share of step time spent outside drafter and target forwards (verification, bookkeeping).
``speedup``
    ``tokens_per_s`` of a method / ``tokens_per_s`` of its autoregressive baseline run in the
    same process on the same prompts (:func:`speedup`).
``tree_expected_tau``
    for token trees: 1 + the tree policy's own expected accepted tokens per step (the sum of its
    estimated path acceptance over the nodes), averaged over steps; the expectation it acted on.
``tree_acceptance``
    for token trees: accepted path length / drafted nodes. Not comparable with a chain's
    ``alpha`` (most nodes of a wide tree are siblings that cannot all be accepted), hence its own
    name; ``alpha`` is None for tree methods.
``tree_drafter_forwards_per_step``
    for token trees: LM drafter forwards per step (level by level: at most one per depth and
    drafter, plus a start when a drafter joins below the root).
``tree_by_drafter``
    for token trees, per drafter: tree nodes it proposed per step, the fraction of them on the
    accepted path (its α inside the tree: siblings lower it, as for ``tree_acceptance``) and its
    ``c``: the time of its calls growing the tree per node it proposed / target time per forward.
``levels``
    for cascades, per inner level: ``alpha`` (accepted by the level above it / drafted) and
    ``c`` (its time per drafted token / target time per verification forward). The top level of
    a vertical cascade is listed with the target's acceptance of its tokens; each entry of a
    horizontal schedule with the target's acceptance of the positions it filled.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from cascade.summary import Decomposition, HeldOut, LevelSummary, RunStats, TreeDrafterSummary
from cascade.theory import expected_tokens_per_position, predicted_speedup
from cascade.types import LevelStats


@dataclass
class Top1Agreement:
    """How often a drafter's argmax equals the target's over held-out positions (a trained head's
    or exit adapter's greedy α of a one-token draft): ``rate`` = agreeing positions / positions."""

    hits: int = 0
    positions: int = 0

    def add(self, drafted, target) -> None:
        """``drafted``, ``target``: [n] token-id tensors at the same n positions."""
        self.hits += int((drafted == target).sum())
        self.positions += drafted.numel()

    @property
    def rate(self) -> float:
        return self.hits / max(self.positions, 1)


def summarize(generations: list) -> RunStats:
    """Run summary of ``cascade.decode.Generation`` objects (see the module docstring). A
    generation without step records (transformers' own ``generate``) counts in tokens and time
    only: its τ and per-forward figures are None."""
    steps = [s for g in generations for s in g.steps]
    new_tokens = sum(len(g.tokens) for g in generations)
    wall = sum(g.wall_time_s for g in generations)
    step_time = sum(s.step_time_s for s in steps)
    target_time = sum(s.target_time_s for s in steps)
    per_forward = target_time / len(steps) if steps else None
    drafted: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    draft_time: dict[str, float] = defaultdict(float)
    for s in steps:
        if s.drafted:
            drafted[s.drafter] += s.drafted
            accepted[s.drafter] += s.accepted
            draft_time[s.drafter] += s.draft_time_s
    total_drafted = sum(drafted.values())
    tree_steps = [s for s in steps if s.tree is not None]
    tree_nodes = sum(s.drafted for s in tree_steps)
    return RunStats(
        num_generations=len(generations),
        new_tokens=new_tokens,
        target_forwards=len(steps),
        tau=sum(s.emitted for s in steps) / len(steps) if steps else None,
        alpha=sum(accepted.values()) / total_drafted if total_drafted and not tree_steps else None,
        alpha_by_drafter={d: accepted[d] / drafted[d] for d in drafted},
        c_by_drafter={d: (draft_time[d] / drafted[d]) / per_forward for d in drafted},
        alpha_by_depth=alpha_by_depth(steps),
        drafted_per_step=total_drafted / len(steps) if steps else 0.0,
        draft_time_per_token_s=sum(draft_time.values()) / total_drafted if total_drafted else None,
        tokens_per_s=new_tokens / wall if wall > 0 else float("nan"),
        wall_time_s=wall,
        prefill_time_s=sum(g.prefill_time_s for g in generations),
        drafter_prefill_time_s=sum(g.drafter_prefill_time_s for g in generations),
        target_time_per_forward_s=per_forward,
        draft_frac=sum(s.draft_time_s for s in steps) / step_time if step_time else 0.0,
        overhead_frac=sum(s.overhead_time_s for s in steps) / step_time if step_time else 0.0,
        levels=_level_stats(steps, per_forward),
        tree_expected_tau=1 + sum(s.tree.expected_accepted for s in tree_steps) / len(tree_steps) if tree_steps else None,
        tree_nodes_per_step=tree_nodes / len(tree_steps) if tree_steps else None,
        tree_acceptance=sum(s.accepted for s in tree_steps) / tree_nodes if tree_nodes else None,
        tree_drafter_forwards_per_step=(sum(s.tree.drafter_forwards for s in tree_steps) / len(tree_steps)
                                        if tree_steps else None),
        tree_by_drafter=_tree_by_drafter(tree_steps, per_forward),
    )


def _tree_by_drafter(tree_steps, per_forward: float | None) -> dict[str, TreeDrafterSummary]:
    """Per drafter of a tree: the nodes it proposed per step, the fraction of them on the
    accepted path, and its time per proposed node over the target's time per forward."""
    nodes: dict[str, int] = defaultdict(int)
    kept: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for s in tree_steps:
        on_path = set(s.accepted_path)
        for i, name in enumerate(s.tree.node_drafters):
            nodes[name] += 1
            kept[name] += i in on_path
        for name, t in s.tree.drafter_seconds.items():
            seconds[name] += t
    return {d: TreeDrafterSummary(nodes[d] / len(tree_steps), kept[d] / nodes[d],
                                  seconds[d] / nodes[d] / per_forward if per_forward else None) for d in nodes}


def alpha_by_depth(steps) -> list[float]:
    """Conditional acceptance rate at each draft depth: accepted at depth i / steps that reached
    depth i. Depth i is reached when the accepted path has i tokens and its last node (or the
    root) has children; for a chain that is: drafted more than i tokens and accepted the first i.
    For a tree it is the tree's acceptance at that depth, over all its branches. With these rates
    ``theory.expected_tokens_per_position`` needs no independence assumption."""
    reached: dict[int, int] = defaultdict(int)
    kept: dict[int, int] = defaultdict(int)
    for s in steps:
        has_children = set(s.parents)
        path = [-1] + s.accepted_path
        for i in range(s.accepted + 1):
            if path[i] in has_children:
                reached[i] += 1
                kept[i] += i < s.accepted
    return [kept[i] / reached[i] for i in sorted(reached)]


def _level_stats(steps, per_forward: float | None) -> dict[str, LevelSummary]:
    """Aggregate the per-level records cascades put in their steps (``cascade``, ``segments``)."""
    acc: dict[str, LevelStats] = defaultdict(LevelStats)
    for s in steps:
        if s.cascade is not None:  # vertical cascade: its top level is judged by the target
            acc[s.cascade.top].add(LevelStats(s.drafted, s.accepted, s.cascade.top_time_s))
            for name, lv in s.cascade.lower.items():
                acc[name].add(lv)
        for seg in s.segments:  # horizontal cascade: the target judges each span
            kept = min(max(s.accepted - seg.start, 0), seg.length)
            acc[seg.drafter].add(LevelStats(seg.length, kept, seg.time_s))
    return {
        name: LevelSummary(drafted=a.drafted, rounds=a.rounds, alpha=a.accepted / a.drafted if a.drafted else None,
                           c=(a.time_s / a.drafted) / per_forward if a.drafted and per_forward else None)
        for name, a in acc.items()
    }


def speedup(method: RunStats, baseline: RunStats) -> float:
    """Ratio of total-token throughputs (not a mean of per-sample ratios)."""
    return method.tokens_per_s / baseline.tokens_per_s


def decode_speedup(method: RunStats, baseline: RunStats) -> float:
    """Ratio of decode-only throughputs (prefills excluded: ``RunStats.decode_tokens_per_s``)."""
    return method.decode_tokens_per_s / baseline.decode_tokens_per_s


def _round_cost(method: RunStats, baseline: RunStats) -> tuple[float, float, float]:
    """(γ, c, verification cost): mean nodes drafted per step, drafter time per drafted node and
    the verification forward's time, both in autoregressive steps of ``baseline``."""
    ar_step = baseline.target_time_per_forward_s
    return (method.drafted_per_step, (method.draft_time_per_token_s or 0.0) / ar_step,
            method.target_time_per_forward_s / ar_step)


def decomposition(method: RunStats, baseline: RunStats) -> Decomposition:
    """The closed forms evaluated at a run's own measurements: in-sample, so a decomposition of
    the measured speedup (which factor costs what), not a prediction of it.

    ``formula_speedup`` is the seed formula (1-α^(γ+1)) / ((1-α)(1+γc)) with α measured, γ the
    mean draft length and c = drafter time per token / autoregressive target step time;
    ``formula_speedup_verify_cost`` also charges the measured verification cost (one forward over
    k+1 tokens / one autoregressive step) instead of assuming it is 1; ``formula_tau_iid`` is the
    τ the single-α formula expects (independent positions). ``decomposed_tau_per_depth`` uses
    the per-depth conditional rates instead (for a fixed draft length it reproduces the measured
    τ by construction) and ``decomposed_speedup_per_depth`` divides it by the measured round
    cost. For token trees the tree policy's own expected τ takes the place of the per-depth τ.
    """
    if not method.drafted_per_step or not baseline.target_time_per_forward_s:
        return Decomposition()
    measured = speedup(method, baseline)
    gamma, c, verify_cost = _round_cost(method, baseline)
    if method.tree_expected_tau is not None:  # token trees: the policy's own expectation
        tau = method.tree_expected_tau
        return Decomposition(decomposed_tau_per_depth=tau, decomposed_speedup_per_depth=tau / (verify_cost + gamma * c))
    if method.alpha is None:
        return Decomposition()
    seed = predicted_speedup(method.alpha, gamma, c)
    tau_depth = expected_tokens_per_position(method.alpha_by_depth[: round(gamma)])
    return Decomposition(
        formula_speedup=seed,
        formula_speedup_verify_cost=predicted_speedup(method.alpha, gamma, c, verify_cost),
        # the gap between these two τ is the cost of the independence assumption (acceptance is
        # correlated along a draft)
        formula_tau_iid=predicted_speedup(method.alpha, gamma, 0.0),
        decomposed_tau_per_depth=tau_depth,
        decomposed_speedup_per_depth=tau_depth / (verify_cost + gamma * c),
        measured_over_formula=measured / seed,
    )


def prediction(fit: RunStats, fit_baseline: RunStats, method: RunStats, baseline: RunStats) -> HeldOut:
    """A prediction from data it did not see: the per-depth decomposition of one set of prompts
    (``fit`` against ``fit_baseline``: per-depth acceptance, draft length, drafter and
    verification cost in autoregressive steps) predicts τ and speedup on other prompts
    (``method`` against ``baseline``), next to what was measured there.

    ``predicted_tau``: the fit's per-depth τ (a token tree: the fit's measured τ);
    ``predicted_speedup``: that τ over the fit's round cost; ``predicted_speedup_formula``: the
    seed formula at the fit's single α, γ, c and verification cost (chains only)."""
    out = HeldOut(fit_prompts=fit.num_generations, test_prompts=method.num_generations, predicted_tau=None,
                  predicted_speedup=None, predicted_speedup_formula=None, measured_tau=method.tau,
                  measured_speedup=speedup(method, baseline), measured_over_predicted=None)
    if not fit.drafted_per_step or not fit_baseline.target_time_per_forward_s:
        return out
    gamma, c, verify_cost = _round_cost(fit, fit_baseline)
    if fit.tree_expected_tau is not None:
        tau = fit.tau
    elif fit.alpha is not None:
        tau = expected_tokens_per_position(fit.alpha_by_depth[: round(gamma)])
        out.predicted_speedup_formula = predicted_speedup(fit.alpha, gamma, c, verify_cost)
    else:
        return out
    out.predicted_tau = tau
    out.predicted_speedup = tau / (verify_cost + gamma * c)
    out.measured_over_predicted = out.measured_speedup / out.predicted_speedup
    return out


def write_jsonl_atomic(path: str | Path, rows) -> None:
    """Write rows as JSON lines to a temp file, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj) -> None:
    """One JSON document, written like :func:`write_jsonl_atomic` (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
