"""Figures: a dynamic tree's α̂/ĉ trajectories and tree size per step, and the speedup bars of
every method of experiments/bench_tree.py (run it first; it writes the JSON this reads).

    python experiments/bench_tree.py --num-prompts 3 --trajectories results/tree_trajectories.json
    python experiments/fig_tree.py results/tree_trajectories.json --out docs/figures
"""

from __future__ import annotations

import argparse
import json

from analysis import figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trajectories")
    ap.add_argument("--out", default="docs/figures")
    args = ap.parse_args()
    data = json.loads(open(args.trajectories).read())
    cfg = data["config"]
    for name, steps in data["trajectories"].items():
        first = [s for s in steps if s["prompt"] == 0]
        _, paths = figures.tree_trajectories(first, f"{name}: {cfg['target']} ← drafters, HumanEval/0, greedy", args.out,
                                             name=f"tree_trajectories_{name}")
        print(*paths, sep="\n")
    speed = {k: v["speedup"] for k, v in data["rows"].items() if k != "ar"}
    _, paths = figures.speedup_bars(speed, f"{cfg['target']}, HumanEval ×{cfg['num_prompts']}, greedy, same run", args.out,
                                    name="speedup_methods")
    print(*paths, sep="\n")


if __name__ == "__main__":
    main()
