"""The draft head's learning curves from ``cascade.train_head`` summaries (``experiments/head_curves.sh``
writes them): held-out top-1 agreement at depths 1-4 after every epoch, by training tokens and
optimiser steps, and a fit that says what would reach a goal.

    python -m analysis.head_curves results/train_head/summary_normed.json results/train_head/curves/*.json \
        --goal 0.5 --goal-depth3 0.3

Printed: every epoch of every run; the runs' agreement at the step count they share (data at
equal steps); and, on each run of three or more epochs (fp32 or bf16), a log-linear fit of
agreement against optimiser steps, extrapolated to the goal, with what the runs' measured
training rates make of it (per precision, the fastest run's: slower ones shared the cores). A fit of three points, on one data set (where a smaller set overfits first, more data
would be needed too): a direction and an order of magnitude, not a prediction.
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
        before = 0.0
        for h in r["history"]:
            rate = h.get("train_tokens_per_s")
            rate = f"{rate:11.0f}" if rate else f"{r['tokens'] / (h['elapsed_s'] - before):10.0f}*"
            before = h["elapsed_s"]
            print(f"{r['name']:14s} {r['tokens']:7d} {h['epoch'] + 1:5d} {h['steps']:5d} {r['precision']:>5s} {rate} "
                  f"{h['train_top1']:11.3f}  " + " / ".join(f"{a:.3f}" for a in h["agreement"]))
    print("(train tok/s: training tokens per second of optimiser steps so far; * that epoch's wall time, its held-out "
          "evaluation included, for summaries written before the rate was recorded)")

    # data at equal steps: every run's epoch closest to the smallest final step count
    steps = min(r["history"][-1]["steps"] for r in runs)
    points: dict[int, list] = {}
    for r in runs:
        h = min(r["history"], key=lambda h: abs(h["steps"] - steps))
        if abs(h["steps"] - steps) <= 0.1 * steps and r["precision"] == "fp32":
            points.setdefault(r["tokens"], []).append((r["name"], h["steps"], h["agreement"]))
    if len(points) >= 2:
        print(f"\nat ~{steps} optimiser steps (fp32):")
        for tokens in sorted(points):
            for name, at, agree in points[tokens]:
                print(f"  {tokens:6d} tokens ({name}, {at} steps): depth 1 {agree[0]:.3f}, depth 3 {agree[2]:.3f}")

    # steps on one data set: each run of 3 or more epochs, agreement against log steps
    by_precision: dict[str, float] = {}  # the fastest recorded training rate per precision
    for r in runs:
        rate = r["history"][-1].get("train_tokens_per_s")
        if rate:
            by_precision[r["precision"]] = max(rate, by_precision.get(r["precision"], 0.0))
    for longest in [r for r in runs if len(r["history"]) >= 3]:
        xs = [math.log(h["steps"]) for h in longest["history"]]
        print(f"\nsteps on {longest['tokens']} tokens ({longest['name']}, {longest['precision']}, {len(longest['history'])} epochs), "
              "log-linear fit over its epochs:")
        for depth, goal in ((0, args.goal), (2, args.goal_depth3)):
            ys = [h["agreement"][depth] for h in longest["history"]]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
            if ys[-1] >= goal:
                print(f"  depth {depth + 1}: {ys[-1]:.3f} >= {goal} reached at {longest['history'][-1]['steps']} steps")
                continue
            if slope <= 0:
                print(f"  depth {depth + 1}: no gain with steps (slope {slope:.3f})")
                continue
            need = math.exp(mx + (goal - my) / slope)
            epochs = need / (longest["history"][-1]["steps"] / len(longest["history"]))
            line = (f"  depth {depth + 1}: +{slope:.3f} per e-fold of steps; {goal} at ~{need:,.0f} steps "
                    f"(~{epochs:.0f} epochs of these {longest['tokens']} tokens)")
            for precision, rate in sorted(by_precision.items()):
                line += f"; {longest['tokens'] * epochs / rate / 3600:.1f} h at {precision}'s {rate:.0f} tokens/s"
            print(line)
        if not by_precision:
            print("  (no run recorded its training rate)")

if __name__ == "__main__":
    main()
