"""The draft head's learning curves from ``cascade.train_head`` summaries (``experiments/head_curves.sh``
writes them): held-out top-1 agreement at depths 1-4 after every epoch, by training tokens and
optimiser steps, and a fit that says what would reach a goal.

    python -m analysis.head_curves results/train_head/summary_normed.json results/train_head/curves/*.json \
        --goal 0.5 --goal-depth3 0.3

The fit: at a fixed step count, agreement grows with log training tokens (two or more data
sizes at about the same steps give the slope); at a fixed data size, more epochs give the
multi-epoch gain. The extrapolation to the goal is a log-linear fit over the runs' last epochs'
data sizes at the step count they share; it says how many tokens that line needs, and what the
runs' measured capture and training rates make of it. A fit of two or three points: a direction
and an order of magnitude, not a prediction.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        m = data["metrics"]
        cfg = data["config"]["train"]
        runs.append({"name": Path(p).stem, "tokens": m["train_tokens"], "epochs": m["epochs"], "history": m["history"],
                     "precision": m.get("precision", "fp32"), "feature_time_s": m.get("feature_time_s"),
                     "capture_tokens": m["train_tokens"] + m["heldout_tokens"], "train_time_s": m["train_time_s"],
                     "lr": cfg["lr"]})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="+")
    ap.add_argument("--goal", type=float, default=0.5, help="depth-1 held-out agreement to reach")
    ap.add_argument("--goal-depth3", type=float, default=0.3)
    args = ap.parse_args()
    runs = load(args.summaries)
    print(f"{'run':14s} {'tokens':>7s} {'epoch':>5s} {'steps':>5s} {'prec':>5s} {'train tok/s':>11s} "
          f"{'train top-1':>11s}  held-out depth 1 / 2 / 3 / 4")
    for r in runs:
        for h in r["history"]:
            rate = h.get("train_tokens_per_s")
            rate = f"{rate:11.0f}" if rate else f"{r['tokens'] * r['epochs'] / r['train_time_s']:10.0f}*"
            print(f"{r['name']:14s} {r['tokens']:7d} {h['epoch'] + 1:5d} {h['steps']:5d} {r['precision']:>5s} {rate} "
                  f"{h['train_top1']:11.3f}  " + " / ".join(f"{a:.3f}" for a in h["agreement"]))
    print("(* the run's whole training time over its tokens x epochs, held-out evaluations included)")

    # data at equal steps: every run's epoch closest to the smallest final step count
    steps = min(r["history"][-1]["steps"] for r in runs)
    points = {}
    for r in runs:
        h = min(r["history"], key=lambda h: abs(h["steps"] - steps))
        if abs(h["steps"] - steps) <= 0.1 * steps:
            points.setdefault(r["tokens"], []).append(h["agreement"])
    if len(points) >= 2:
        xs = sorted(points)
        ys1 = [sum(a[0] for a in points[x]) / len(points[x]) for x in xs]
        ys3 = [sum(a[2] for a in points[x]) / len(points[x]) for x in xs]
        print(f"\nat ~{steps} steps: " + ", ".join(f"{x} tokens -> {a:.3f} / {b:.3f} (depth 1 / 3)" for x, a, b in zip(xs, ys1, ys3)))
        for depth, ys, goal in ((1, ys1, args.goal), (3, ys3, args.goal_depth3)):
            lx = [math.log(x) for x in xs]
            mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
            slope = sum((a - mx) * (b - my) for a, b in zip(lx, ys)) / sum((a - mx) ** 2 for a in lx)
            if slope <= 0:
                print(f"depth {depth}: agreement does not grow with tokens at this step count (slope {slope:.3f})")
                continue
            need = math.exp(mx + (goal - my) / slope)
            print(f"depth {depth}: +{slope:.3f} agreement per e-fold of tokens; {goal} at ~{need:,.0f} training tokens "
                  f"(x{need / xs[-1]:.0f} the largest run) on this line")
            captured = [r for r in runs if r["feature_time_s"] and r["feature_time_s"] > 60]
            trained = [(r["tokens"] * len(r["history"]), r["history"][-1].get("train_tokens_per_s")) for r in runs]
            rates = [t for _, t in trained if t]
            if captured and rates:
                cap = captured[0]["capture_tokens"] / captured[0]["feature_time_s"]
                best = max(rates)
                hours = (need / cap + need / best) / 3600
                print(f"  at {cap:.0f} tokens/s capture and {best:.0f} tokens/s training (one epoch): ~{hours:.1f} h on this CPU")


if __name__ == "__main__":
    main()
