"""The figures, as functions of gathered results. Each writes ``NAME.png`` and ``NAME.pdf`` into
``out_dir`` and returns the figure (so tests can inspect its axes) and the paths.

    ewif_curves          speedup vs draft length γ: theory for the measured α, c (a family over α
                         and c), the measured sweep points with their spread across prompts, the
                         optimal γ marked
    ewif_two_level_map   two-level cascade EWIF over the two budgets (contour), measured points
    alpha_by_depth       conditional acceptance per depth, one line per method/drafter
    tau_histogram        tokens per target forward, per method
    speedup_bars         speedup per method, autoregressive at 1.0
    tree_trajectories    a dynamic tree's α̂ and ĉ over a generation, and the tree size per step
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cascade import theory  # noqa: E402  (pure math; loads no model)


def save(fig, out_dir: str | Path, name: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=130)
    plt.close(fig)
    return paths


def _chain_speedup(alpha: float, gamma: int, c: float, verify=None) -> float:
    cost = 1.0 + gamma * c if verify is None else verify(gamma) + gamma * c
    return theory.expected_tokens(alpha, gamma) / cost


def ewif_curves(points: list[dict], alpha: float, c: float, title: str, out_dir, verify=None,
                max_gamma: int = 10, name: str = "ewif", alpha_by_depth: list[float] | None = None):
    """points: [{"gamma", "speedup", "lo", "hi"}] measured (lo/hi: spread across prompts).
    verify: optional γ -> verification forward cost / one AR step (measured growth); the seed
    formula assumes 1. alpha_by_depth: measured conditional acceptance per depth: adds the curve
    without the independence assumption (τ from ``theory.expected_tokens_per_position``)."""
    gammas = np.arange(0, max_gamma + 1)
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for da in (-0.15, 0.15):
        a = min(max(alpha + da, 0.01), 0.99)
        ax.plot(gammas, [_chain_speedup(a, g, c) for g in gammas], color="0.75", lw=1, ls=":")
        ax.annotate(f"α={a:.2f}", (gammas[-1] + 0.1, _chain_speedup(a, gammas[-1], c)), fontsize=7, color="0.5", va="bottom")
    for fc in (0.5, 2.0):
        ax.plot(gammas, [_chain_speedup(alpha, g, c * fc) for g in gammas], color="0.75", lw=1, ls="--")
        ax.annotate(f"c={c * fc:.2f}", (gammas[-1] - 1.5, _chain_speedup(alpha, gammas[-1] - 1.5, c * fc)), fontsize=7, color="0.5", va="top")
    seed = [_chain_speedup(alpha, g, c) for g in gammas]
    ax.plot(gammas, seed, color="C0", lw=2, label=f"seed formula, α={alpha:.2f}, c={c:.2f}")
    g_opt = int(np.argmax(seed))
    ax.plot([g_opt], [seed[g_opt]], marker="*", ms=14, color="C0", ls="none", label=f"optimal γ (seed) = {g_opt}")
    if verify is not None:
        charged = [_chain_speedup(alpha, g, c, verify) for g in gammas]
        ax.plot(gammas, charged, color="C1", lw=2, label="with measured verification cost")
        g2 = int(np.argmax(charged))
        ax.plot([g2], [charged[g2]], marker="*", ms=14, color="C1", ls="none", label=f"optimal γ (charged) = {g2}")
    if alpha_by_depth and verify is not None:
        gs = np.arange(0, min(max_gamma, len(alpha_by_depth)) + 1)
        depth = [theory.expected_tokens_per_position(alpha_by_depth[:g]) / (verify(g) + g * c) for g in gs]
        ax.plot(gs, depth, color="C2", lw=2, label="per-depth α + measured verification cost")
        g3 = int(np.argmax(depth))
        ax.plot([gs[g3]], [depth[g3]], marker="*", ms=14, color="C2", ls="none", label=f"optimal γ (per-depth) = {gs[g3]}")
    if points:
        pts = sorted(points, key=lambda p: p["gamma"])
        x = [p["gamma"] for p in pts]
        y = [p["speedup"] for p in pts]
        err = [[p["speedup"] - p.get("lo", p["speedup"]) for p in pts], [p.get("hi", p["speedup"]) - p["speedup"] for p in pts]]
        ax.errorbar(x, y, yerr=err, fmt="o", color="k", capsize=3, label="measured (range over prompts)")
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xlabel("draft length γ (tokens per round)")
    ax.set_ylabel("speedup over autoregressive (EWIF)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return fig, save(fig, out_dir, name)


def ewif_two_level_map(alpha: float, beta: float, c1: float, c2: float, title: str, out_dir,
                       points: list[dict] | None = None, max_n: int = 8, max_k: int = 8, name: str = "ewif_two_level"):
    """EWIF of a two-level cascade over n (middle-model rounds per target round) and k (lower
    drafter tokens per middle round), from measured α (target vs middle), β (middle vs lower) and
    costs c1, c2 (per token, relative to one target step). points: [{"n", "k", "speedup"}]."""
    ns, ks = np.arange(1, max_n + 1), np.arange(1, max_k + 1)
    grid = np.array([[theory.ewif_two_level(alpha, beta, n, k, c1, c2) for n in ns] for k in ks])
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    cs = ax.contourf(ns, ks, grid, levels=14, cmap="viridis")
    fig.colorbar(cs, ax=ax, label="EWIF at the run's α, β, c (in-sample)")
    i, j = np.unravel_index(np.argmax(grid), grid.shape)
    ax.plot([ns[j]], [ks[i]], marker="*", ms=14, color="w", ls="none", label=f"optimum n={ns[j]}, k={ks[i]}")
    for p in points or []:
        ax.annotate(f"{p['speedup']:.2f}", (p["n"], p["k"]), color="w", fontsize=8, ha="center",
                    bbox={"boxstyle": "round", "fc": "k", "alpha": 0.5})
    ax.set_xlabel("middle-model rounds per target round n")
    ax.set_ylabel("lower-drafter tokens per middle round k")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return fig, save(fig, out_dir, name)


def alpha_by_depth(series: dict[str, list[float]], title: str, out_dir, name: str = "alpha_by_depth"):
    """series: label -> conditional acceptance at depth 1, 2, ..."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, alphas in series.items():
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=label)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft depth (position in the draft)")
    ax.set_ylabel("acceptance rate given the previous accepted")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig, save(fig, out_dir, name)


def tau_histogram(taus: dict[str, list[int]], title: str, out_dir, name: str = "tau_hist"):
    """taus: method -> tokens emitted per target forward, one entry per step."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max((max(v) for v in taus.values() if v), default=1)
    bins = np.arange(0.5, top + 1.5)
    for label, values in taus.items():
        ax.hist(values, bins=bins, alpha=0.55, density=True, label=f"{label} (mean {np.mean(values):.2f})")
    ax.set_xlabel("tokens per target forward τ")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig, save(fig, out_dir, name)


def speedup_bars(speedups: dict[str, float], title: str, out_dir, spread: dict[str, tuple[float, float]] | None = None,
                 name: str = "speedup"):
    """speedups: method -> speedup over autoregressive (which is drawn at 1.0)."""
    items = [("autoregressive", 1.0)] + [(k, v) for k, v in speedups.items() if k not in ("ar", "autoregressive")]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(items)), 4.2))
    labels = [k for k, _ in items]
    values = [v for _, v in items]
    yerr = None
    if spread:
        yerr = [[v - spread.get(k, (v, v))[0] for k, v in items], [spread.get(k, (v, v))[1] - v for k, v in items]]
    ax.bar(labels, values, color=["0.6"] + [f"C{i}" for i in range(len(items) - 1)], yerr=yerr, capsize=3)
    ax.axhline(1.0, color="k", lw=0.8)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.2f}x", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(title, fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right", fontsize=8)
    return fig, save(fig, out_dir, name)


def speedup_by_category(speedups: dict[str, list[float]], categories: list[str], title: str, out_dir,
                        name: str = "speedup_by_category"):
    """speedups: method -> speedup over autoregressive per category (same order as ``categories``);
    grouped bars, one group per category."""
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(categories)), 4.6))
    n = len(speedups)
    width = 0.8 / max(n, 1)
    x = np.arange(len(categories))
    for i, (method, vals) in enumerate(speedups.items()):
        ax.bar(x + (i - (n - 1) / 2) * width, vals, width, label=method, color=f"C{i}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(categories, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    return fig, save(fig, out_dir, name)


def tree_trajectories(steps: list[dict], title: str, out_dir, name: str = "tree_trajectories"):
    """steps: per step {"nodes", "estimates": {"alpha": {drafter: {key: {"mean"}}}, "forward_curve_s": {drafter:
    {width: seconds}} (an LM drafter's forwards), "drafter_cost_s": {drafter: s} (a forward-free
    drafter's proposal), "verify_curve_s": {inputs: seconds}}}, in order (one generation or several
    back to back). ĉ is drawn for a one-node forward, in target steps."""
    fig, axes = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    x = np.arange(len(steps))
    depth1 = sorted({d for s in steps for d, keys in s["estimates"]["alpha"].items() if "depth1" in keys})
    for d in depth1:
        axes[0].plot(x, [s["estimates"]["alpha"].get(d, {}).get("depth1", {}).get("mean", np.nan) for s in steps], label=d)
    axes[0].set_ylabel("α̂ at depth 1 (posterior mean)")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)
    def first(curve: dict | None) -> float:
        """The smallest measured size's seconds (width / inputs 1 when measured)."""
        return curve[min(curve, key=int)] if curve else np.nan

    def seconds(est: dict, d: str) -> float:
        curve = est.get("forward_curve_s", {}).get(d)
        return first(curve) if curve else est.get("drafter_cost_s", {}).get(d, np.nan)

    drafters = sorted({d for s in steps for key in ("forward_curve_s", "drafter_cost_s") for d in s["estimates"].get(key, {})})
    unit = [first(s["estimates"].get("verify_curve_s")) for s in steps]
    for d in drafters:
        axes[1].plot(x, [seconds(s["estimates"], d) / u if u else np.nan for s, u in zip(steps, unit)], label=d)
    axes[1].set_ylabel("ĉ (drafter call / target step)")
    axes[1].legend(fontsize=7)
    axes[2].bar(x, [s["nodes"] for s in steps], color="C2", label="tree nodes")
    if any("accepted" in s for s in steps):
        axes[2].plot(x, [s.get("accepted", np.nan) for s in steps], color="k", lw=1, label="accepted")
    axes[2].set_ylabel("nodes per step")
    axes[2].set_xlabel("decoding step")
    axes[2].legend(fontsize=7)
    axes[0].set_title(title, fontsize=10)
    return fig, save(fig, out_dir, name)
