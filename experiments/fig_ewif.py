"""Figure: EWIF curves from a real draft-length sweep, and the trace-replay check.

1. runs the sweep (Hydra multirun): Qwen2.5-Coder-1.5B target, 0.5B drafter (bf16, greedy
   argmax drafts, no stop policy), HumanEval, greedy, γ = method.drafter.k in --gammas;
2. plots it (python -m analysis.plot_ewif SWEEP --out FIG_DIR);
3. replays the largest-γ run's trace at the other draft lengths and prints the predicted vs
   measured speedup (python -m analysis.simulate).

    python experiments/fig_ewif.py --gammas 1,2,3,4,6,8 --num-prompts 3 --max-new-tokens 48 --out docs/figures
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gammas", default="1,2,3,4,6,8")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sweep-dir", default="multirun/fig_ewif")
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--skip-sweep", action="store_true", help="only plot an existing --sweep-dir")
    args = ap.parse_args()
    if not args.skip_sweep:
        subprocess.run([
            sys.executable, "-m", "cascade.run", "-m", "+experiment=sps_small_lm", f"method.drafter.k={args.gammas}",
            f"dataset.num_prompts={args.num_prompts}", f"dataset.max_new_tokens={args.max_new_tokens}",
            f"hydra.sweep.dir={args.sweep_dir}", "progress=false",
        ], check=True)
    subprocess.run([sys.executable, "-m", "analysis.plot_ewif", args.sweep_dir, "--out", args.out], check=True)
    jobs = sorted(Path(args.sweep_dir).glob("*/summary.json"), key=lambda p: int(p.parent.name.split("_")[0]))
    gammas = [int(g) for g in args.gammas.split(",")]
    largest = jobs[gammas.index(max(gammas))].parent
    subprocess.run([sys.executable, "-m", "analysis.simulate", str(largest), "--gammas", args.gammas,
                    "--compare", args.sweep_dir], check=True)


if __name__ == "__main__":
    main()
