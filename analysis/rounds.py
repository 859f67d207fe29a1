"""Where a round's time goes, per method of one run, in autoregressive steps: the target's
verification forward, the drafting, the acceptance rule and the rest of the loop (commit,
observe, records), from the run's ``steps.jsonl`` (the baseline's mean step time is one step).

    python -m analysis.rounds RUN_DIR
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from cascade.metrics import decode_speedup
from cascade.results import load_jobs


def round_parts(steps: list[dict]) -> dict[str, dict[str, float]]:
    """method -> mean seconds per round of verify / draft / accept / other, tokens per round and
    inputs per verification (``[last] + draft``)."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        by_method[s["method"]].append(s)
    out = {}
    for name, rows in by_method.items():
        accept = [r.get("accept_time_s") or 0.0 for r in rows]
        out[name] = {
            "verify": statistics.mean(r["target_time_s"] for r in rows),
            "draft": statistics.mean(r["draft_time_s"] for r in rows),
            "accept": statistics.mean(accept),
            "other": statistics.mean(r["step_time_s"] - r["target_time_s"] - r["draft_time_s"] - a for r, a in zip(rows, accept)),
            "tokens": statistics.mean(r["emitted"] for r in rows),
            "inputs": statistics.mean(1 + r["drafted"] for r in rows),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    jobs, _ = load_jobs(args.run_dir)
    for job in jobs:
        parts = round_parts(job.steps())
        base = job.summary.baseline
        step = parts[base]["verify"] + parts[base]["draft"] + parts[base]["accept"] + parts[base]["other"]
        print(f"{job.dir}: one autoregressive step = {1000 * step:.1f} ms (the baseline's mean round)")
        print(f"{'method':16s} {'tokens':>7s} {'inputs':>7s} {'verify':>7s} {'draft':>7s} {'accept':>7s} {'other':>7s} "
              f"{'round':>7s} {'decode':>7s} {'whole':>7s}")
        for name, p in parts.items():
            total = p["verify"] + p["draft"] + p["accept"] + p["other"]
            method = job.summary.methods[name]
            decode = f"{decode_speedup(method.stats, job.summary.methods[base].stats):.2f}x"
            print(f"{name:16s} {p['tokens']:7.2f} {p['inputs']:7.2f} " + " ".join(
                f"{p[k] / step:7.3f}" for k in ("verify", "draft", "accept", "other"))
                + f" {total / step:7.3f} {decode:>7s} {method.speedup:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
