"""Figures: a dynamic tree's α̂/ĉ trajectories and tree size per step, and the speedup bars of
every method of experiments/bench_tree.py, per prompt set (run it first; it writes the JSON this
reads).

    python experiments/bench_tree.py --num-prompts 4 --chat-prompts 3 --out results/bench_tree.json
    python experiments/fig_tree.py results/bench_tree.json --out docs/figures
"""

from __future__ import annotations

import argparse
import json

from analysis import figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="the JSON bench_tree.py wrote (--out)")
    ap.add_argument("--out", default="docs/figures")
    args = ap.parse_args()
    data = json.loads(open(args.results).read())
    cfg = data["config"]
    for set_name, steps in data["trajectories"].items():
        first = [s for s in steps if s["prompt"] == 0]
        _, paths = figures.tree_trajectories(first, f"dytc: {cfg['target']} ← int8 0.5B + prompt lookup, {set_name}/0, greedy",
                                             args.out, name=f"tree_trajectories_{set_name}")
        print(*paths, sep="\n")
    for set_name, rows in data["rows"].items():
        speed = {k: v["speedup"] for k, v in rows.items() if k != "ar"}
        _, paths = figures.speedup_bars(speed, f"{cfg['target']}, {set_name}, greedy, same run", args.out,
                                        name=f"speedup_trees_{set_name}")
        print(*paths, sep="\n")


if __name__ == "__main__":
    main()
