"""DyTC against the chains it contains, per run: for every tree method, the best chain method of
the same run whose drafter is one of the tree's drafters (matched by drafter name), the ratio of
their decode and whole-call speedups, and the tree's shape (nodes per round, deepest node, the
share of rounds verified as one chain by choice); with two runs of the same command, how much
each tree's shape moved between them; and for two methods that draft alike (an A/A control), the
ratio of their speedups: the noise between two methods of one run.

    python -m analysis.guarantee RUN_DIR [OTHER_RUN_DIR]
"""

from __future__ import annotations

import argparse
import statistics

from cascade.results import load_jobs
from cascade.tree_structure import depths_of


def contained_chains(methods: dict) -> dict[str, list[str]]:
    """tree method -> the chain methods of its drafters (a method is a tree when its drafter has parts)."""
    chains = {n: m.drafter.name for n, m in methods.items() if not m.drafter.parts and m.drafter.kind != "autoregressive"}
    return {n: [c for c, name in chains.items() if name in {p.name for p in m.drafter.parts}]
            for n, m in methods.items() if m.drafter.parts and "tree" in m.drafter.kind}


def twins(methods: dict) -> list[tuple[str, str]]:
    """Pairs of chain methods of one run that draft alike (the same drafter description): an A/A
    control, whose ratio is the host's noise between two methods doing the same work."""
    names = [n for n, m in methods.items() if m.drafter.kind != "autoregressive" and not m.drafter.parts]  # chains
    # (trees' descriptions leave their policies' settings out: two trees that describe alike may differ)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if methods[a].drafter == methods[b].drafter]


def shape(steps: list[dict], method: str) -> dict[str, float]:
    rows = [s for s in steps if s["method"] == method and s["drafted"]]
    if not rows:
        return {"nodes": 0.0, "depth": 0.0, "chains": 0.0}
    chains = [s for s in rows if s.get("tree") and s["tree"].get("shape") == "chain"]
    return {"nodes": statistics.mean(s["drafted"] for s in rows),
            "depth": statistics.mean(max(depths_of(s["parents"])) for s in rows),
            "chains": len(chains) / len(rows)}


def rows(job) -> list[dict]:
    """Per tree method: the best chain of its drafters by decode-only and by whole-call speedup,
    and the ratios. A chain run twice (an A/A control) counts once, at the mean of its two runs:
    the larger of two runs of the same work is that work plus the noise, not a better chain."""
    methods, steps = job.summary.methods, job.steps()
    second = {b: a for a, b in twins(methods)}

    def value(c: str, attr: str) -> float:
        runs = [c] + [b for b, a in second.items() if a == c]
        return statistics.mean(getattr(methods[r], attr) or 0.0 for r in runs)

    out = []
    for tree, chains in contained_chains(methods).items():
        chains = [c for c in chains if c not in second]
        if not chains:
            continue
        best_decode = max(chains, key=lambda c: value(c, "decode_speedup"))
        best_whole = max(chains, key=lambda c: value(c, "speedup"))
        t = methods[tree]
        out.append({"method": tree, "decode": t.decode_speedup, "whole": t.speedup,
                    "chain_decode": best_decode, "vs_decode": t.decode_speedup / value(best_decode, "decode_speedup"),
                    "chain_whole": best_whole, "vs_whole": t.speedup / value(best_whole, "speedup"),
                    **shape(steps, tree)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    args = ap.parse_args(argv)
    shapes: dict[tuple[str, str], list[dict]] = {}
    for run_dir in args.run_dirs:
        jobs, _ = load_jobs(run_dir)
        for job in jobs:
            print(f"{job.dir} ({job.summary.clock})")
            print(f"  {'method':22s} {'decode':>7s} {'best chain':>18s} {'ratio':>6s} {'whole':>7s} {'best chain':>18s} "
                  f"{'ratio':>6s} {'nodes':>6s} {'depth':>6s} {'chains':>6s}")
            for r in rows(job):
                print(f"  {r['method']:22s} {r['decode']:6.2f}x {r['chain_decode']:>18s} {r['vs_decode']:6.3f} "
                      f"{r['whole']:6.2f}x {r['chain_whole']:>18s} {r['vs_whole']:6.3f} {r['nodes']:6.2f} "
                      f"{r['depth']:6.2f} {r['chains']:6.1%}")
                shapes.setdefault((job.summary.dataset, r["method"]), []).append(r)  # a set's runs, whatever their dirs' names
            methods = job.summary.methods
            for a, b in twins(methods):
                print(f"  A/A control {a} / {b}: decode {methods[a].decode_speedup / methods[b].decode_speedup:.3f}, "
                      f"whole {methods[a].speedup / methods[b].speedup:.3f} (the same drafts: the host's noise between methods)")
    pairs = {k: v for k, v in shapes.items() if len(v) == 2}
    if pairs:
        print("tree shape between the two runs (relative change of nodes per round and depth):")
        for (dataset, method), (a, b) in pairs.items():
            print(f"  {dataset:28s} {method:22s} nodes {a['nodes']:.2f} -> {b['nodes']:.2f} "
                  f"({abs(b['nodes'] - a['nodes']) / max(a['nodes'], 1e-9):.1%}), depth {a['depth']:.2f} -> {b['depth']:.2f} "
                  f"({abs(b['depth'] - a['depth']) / max(a['depth'], 1e-9):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
