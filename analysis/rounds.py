"""Where a round's time goes, per method of one run, in autoregressive steps: the target's
verification forward, the drafting, the acceptance rule and the rest of the loop (commit,
observe, records), from the run's ``steps.jsonl`` (the baseline's mean step time is one step);
then the shape of the drafts: nodes per round, the deepest node, and per round the first
children (the first child of each parent: a chain's every node) and the siblings below them,
each with the fraction the target accepted; then, for the policies that predict acceptance
(DyTC), predicted against accepted tokens per node kind (per drafter: first children, siblings
by rank), over the nodes whose parent was accepted (the ones the target judged), and the share
of rounds the policy verified one chain on purpose (its guard or its realised-outcome check);
last, the same round decomposition per mode of those policies (the rounds drafted as one chain,
the rounds drafted as a tree), with tokens per step of each: which mode's rounds fall short.

    python -m analysis.rounds RUN_DIR
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from cascade.metrics import decode_speedup
from cascade.results import load_jobs
from cascade.tree_structure import children_of, depths_of


def round_parts(steps: list[dict], key=lambda s: s["method"]) -> dict[str, dict[str, float]]:
    """key (the method, unless told) -> mean seconds per round of verify / draft / accept / other,
    tokens per round, inputs per verification (``[last] + draft``) and rounds; steps whose key is
    None are left out."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        if (k := key(s)) is not None:
            by_method[k].append(s)
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
            "rounds": len(rows),
        }
    return out


def round_seconds(parts: dict[str, float]) -> float:
    """A row of ``round_parts``: its mean round, verify + draft + accept + other."""
    return parts["verify"] + parts["draft"] + parts["accept"] + parts["other"]


def mode_of(step: dict) -> str | None:
    """"<method> [chain]" / "<method> [tree]" for a round of a policy that records which mode it
    drafted in (DyTC), else None."""
    shape = (step.get("tree") or {}).get("shape")
    return f"{step['method']} [{shape}]" if shape else None


def draft_shape(steps: list[dict]) -> dict[str, dict[str, float]]:
    """method -> per drafting round: nodes, deepest depth, first children and siblings (each
    parent's first child / the later ones) and the fraction of each the target accepted."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        if s["drafted"]:
            by_method[s["method"]].append(s)
    out = {}
    for name, rows in by_method.items():
        first = first_ok = siblings = siblings_ok = 0
        for r in rows:
            accepted = set(r["accepted_path"])
            for kids in children_of(r["parents"]):
                first += bool(kids)
                first_ok += bool(kids) and kids[0] in accepted
                siblings += max(len(kids) - 1, 0)
                siblings_ok += sum(k in accepted for k in kids[1:])
        n = len(rows)
        out[name] = {"rounds": n, "nodes": sum(r["drafted"] for r in rows) / n,
                     "depth": statistics.mean(max(depths_of(r["parents"])) for r in rows),
                     "first": first / n, "first_accepted": first_ok / max(first, 1),
                     "siblings": siblings / n, "siblings_accepted": siblings_ok / max(siblings, 1)}
    return out


def calibration(steps: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """method -> node kind ("<drafter> first", "<drafter> sibling r2", ...) -> judged nodes, the
    policy's predicted accepted (the sum of its α̂ given the parent) and the accepted; plus the
    share of rounds verified as one chain by choice (kind "rounds as chains")."""
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for s in steps:
        tree = s.get("tree")
        if not tree or not tree.get("node_alpha"):
            continue
        kinds = out[s["method"]]
        chains = kinds.setdefault("rounds as chains", {"judged": 0, "predicted": 0.0, "accepted": 0})
        chains["judged"] += 1
        chains["accepted"] += tree.get("shape") == "chain"
        accepted = set(s["accepted_path"])
        for j, (parent, drafter, rank, alpha) in enumerate(zip(s["parents"], tree["node_drafters"], tree["node_ranks"],
                                                               tree["node_alpha"])):
            if parent >= 0 and parent not in accepted:
                continue  # never judged: its parent was rejected
            kind = kinds.setdefault(f"{drafter} {'first' if rank == 1 else f'sibling r{rank}'}",
                                    {"judged": 0, "predicted": 0.0, "accepted": 0})
            kind["judged"] += 1
            kind["predicted"] += alpha
            kind["accepted"] += j in accepted
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    jobs, _ = load_jobs(args.run_dir)
    for job in jobs:
        parts = round_parts(job.steps())
        base = job.summary.baseline
        step = round_seconds(parts[base])
        print(f"{job.dir}: one autoregressive step = {1000 * step:.1f} ms (the baseline's mean round)")
        print(f"{'method':16s} {'tokens':>7s} {'inputs':>7s} {'verify':>7s} {'draft':>7s} {'accept':>7s} {'other':>7s} "
              f"{'round':>7s} {'decode':>7s} {'whole':>7s} {'tok/step':>8s}")
        for name, p in parts.items():
            total = round_seconds(p)
            method = job.summary.methods[name]
            decode = f"{decode_speedup(method.stats, job.summary.methods[base].stats):.2f}x"
            print(f"{name:16s} {p['tokens']:7.2f} {p['inputs']:7.2f} " + " ".join(
                f"{p[k] / step:7.3f}" for k in ("verify", "draft", "accept", "other"))
                + f" {total / step:7.3f} {decode:>7s} {method.speedup:6.2f}x {p['tokens'] * step / total:8.2f}")
        print(f"{'drafts':16s} {'rounds':>7s} {'nodes':>7s} {'depth':>7s} {'first':>7s} {'(acc)':>7s} {'sibling':>7s} {'(acc)':>7s}")
        for name, d in draft_shape(job.steps()).items():
            print(f"{name:16s} {d['rounds']:7d} {d['nodes']:7.2f} {d['depth']:7.2f} {d['first']:7.2f} "
                  f"{d['first_accepted']:7.2f} {d['siblings']:7.2f} {d['siblings_accepted']:7.2f}")
        for name, kinds in calibration(job.steps()).items():
            print(f"{name}: predicted vs accepted per node kind (nodes whose parent was accepted)")
            print(f"  {'kind':34s} {'judged':>7s} {'predicted':>9s} {'accepted':>8s} {'ratio':>6s}")
            for kind, k in sorted(kinds.items()):
                if kind == "rounds as chains":
                    continue
                ratio = f"{k['predicted'] / k['accepted']:.2f}" if k["accepted"] else "-"
                print(f"  {kind:34s} {k['judged']:7d} {k['predicted']:9.1f} {k['accepted']:8d} {ratio:>6s}")
            c = kinds["rounds as chains"]
            print(f"  rounds verified as one chain by choice: {c['accepted']} of {c['judged']}")
        modes = round_parts(job.steps(), key=mode_of)
        if modes:
            print("per mode (in steps; tok/step = tokens per round over the round's time)")
            print(f"{'mode':22s} {'rounds':>7s} {'tokens':>7s} {'inputs':>7s} {'verify':>7s} {'draft':>7s} {'round':>7s} "
                  f"{'tok/step':>8s}")
            for name, p in sorted(modes.items()):
                total = round_seconds(p) / step
                print(f"{name:22s} {p['rounds']:7d} {p['tokens']:7.2f} {p['inputs']:7.2f} {p['verify'] / step:7.3f} "
                      f"{p['draft'] / step:7.3f} {total:7.3f} {p['tokens'] / total:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
