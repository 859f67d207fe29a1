"""`python -m analysis.plot_ewif SWEEP_OR_RUN_DIR --out FIG_DIR`: EWIF curves from a sweep.

For chain methods (one drafter, ``method.drafter.k`` = γ swept or fixed): the theoretical
speedup vs γ for the α and c measured in the sweep (pooled over its jobs), a family of curves
around them, the curve that also charges the measured verification cost (a forward over γ + 1
tokens costs more than one autoregressive step on CPU), the measured points with their range
across prompts, and the optimal γ. For two-level vertical cascades: the EWIF map over the two
budgets from the measured α, β, c1, c2, with the measured point(s). Also writes the α-by-depth,
τ-histogram and speedup-bar figures of the same jobs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from analysis import figures
from analysis.gather import GatherError, complete_jobs


def _methods(job) -> list[str]:
    """The methods a job compared with its baseline (several in a multi-method experiment)."""
    names = list(job.summary.compared)
    if not names:
        raise GatherError(f"{job.dir}: only the baseline was run")
    return names


def chain_points(jobs) -> tuple[list[dict], float, float, callable, str]:
    """Measured points, pooled α and c, the verification-cost function and a title, from
    (job, method name) pairs of chain methods."""
    points, acc, drafted, cs, vc = [], 0.0, 0.0, [], []
    depth_alphas: list[float] = []
    best_k = 0
    for job, name in jobs:
        m = job.summary.methods[name]
        d = m.stats
        base = job.summary.methods[job.summary.baseline].stats
        info = job.drafter(name)
        k = info.budget
        if not k or info.parts or d.alpha is None:
            continue
        lo, hi = job.summary.speedup_range(name)
        points.append({"gamma": int(k), "speedup": m.speedup, "lo": lo, "hi": hi})
        n = d.drafted_per_step * d.target_forwards
        acc += d.alpha * n
        drafted += n
        # per drafted token; the drafter's prefill of each prompt is recorded on its own
        cs.append(d.draft_time_per_token_s / base.target_time_per_forward_s)
        vc.append((d.drafted_per_step, d.target_time_per_forward_s / base.target_time_per_forward_s))
        if int(k) > best_k:  # per-depth rates from the longest drafts measured
            best_k, depth_alphas = int(k), d.alpha_by_depth
    if not points:
        raise GatherError("no chain-method job with a draft length (method.drafter.k) and drafted tokens found")
    alpha, c = acc / drafted, float(np.median(cs))
    # verification cost / one AR step as a function of γ: piecewise linear through (0, 1) and the
    # measured (mean draft length, cost) of each job; flat beyond the last
    xs, ys = zip(*sorted([(0.0, 1.0)] + vc))
    verify = lambda g: float(np.interp(g, xs, ys))  # noqa: E731
    first, name = jobs[0]
    run = first.summary
    title = (f"{run.target} ← {name} ({run.small}), {run.dataset} ×{run.num_prompts}, "
             f"{'greedy' if run.greedy else 'sampled'}")
    return points, alpha, c, verify, title, depth_alphas


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a run directory or a multirun sweep directory")
    ap.add_argument("--out", required=True, help="figure directory (PNG and PDF)")
    args = ap.parse_args(argv)
    jobs = complete_jobs(args.results)
    if not jobs:
        return 1
    written = []
    pairs = [(j, name) for j in jobs for name in _methods(j)]
    cascades = [(j, n) for j, n in pairs if j.drafter(n).kind == "vertical_cascade"]
    chains = [(j, n) for j, n in pairs if j.drafter(n).chain]
    if chains:
        points, alpha, c, verify, title, depth = chain_points(chains)
        _, paths = figures.ewif_curves(points, alpha, c, title, args.out, verify=verify, alpha_by_depth=depth)
        written += paths
        print(f"chain: pooled alpha {alpha:.3f}, c {c:.3f}; measured points " +
              ", ".join(f"γ={p['gamma']}: {p['speedup']:.2f}x" for p in sorted(points, key=lambda p: p["gamma"])))
    for job, name in cascades[:1]:
        m = job.summary.methods[name]
        levels = m.stats.levels
        top, lower = list(levels)[:2]
        lv_top, lv_low = levels[top], levels[lower]
        title = f"{job.summary.target} ← {top} ← {lower}, {job.summary.dataset}"
        k = job.drafter(name).parts[1].budget
        pts = []
        if lv_low.rounds:
            pts.append({"n": lv_low.rounds / m.stats.target_forwards, "k": k, "speedup": m.speedup})
        _, paths = figures.ewif_two_level_map(lv_top.alpha, lv_low.alpha, lv_top.c, lv_low.c, title, args.out, points=pts)
        written += paths
    # the companion figures of the same jobs
    series, taus, speeds = {}, {}, {}
    for job, name in pairs:
        label = f"{name} " + " ".join(f"{k}={v}" for k, v in job.params.items()) if job.params else name
        m = job.summary.methods[name]
        if m.stats.alpha_by_depth:
            series[label] = m.stats.alpha_by_depth
        speeds[label] = m.speedup
        taus[label] = [s["emitted"] for s in job.steps() if s["method"] == name]
    if series:
        written += figures.alpha_by_depth(series, "acceptance by depth", args.out)[1]
    written += figures.tau_histogram(taus, "tokens per target forward", args.out)[1]
    written += figures.speedup_bars(speeds, "speedup over autoregressive (same run)", args.out)[1]
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
