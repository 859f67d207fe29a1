"""`python -m analysis.plot_run RUN_DIR --out FIG_DIR`: the figures of one multi-method run.

* ``speedup_<experiment>_<dataset>``: every method's speedup over the baseline in the run, with
  its range across prompts;
* ``speedup_by_category_<experiment>`` (runs over several prompt categories, ``dataset=mixed``);
* ``tree_trajectories_<method>_<dataset>`` for every DyTC tree (the tree priced by its
  α̂ / ĉ estimates and tree size per step over the first prompt, from ``steps.jsonl``).
"""

from __future__ import annotations

import argparse
import sys

from analysis import figures
from analysis.gather import complete_jobs


def plot_job(job, out: str) -> list:
    run = job.summary
    tag = f"{run.experiment.replace('/', '_')}_{run.dataset}"
    title = f"{run.target}, {run.dataset} ×{run.num_prompts}, {'greedy' if run.greedy else 'sampled'}, same run"
    written = figures.speedup_bars({n: m.speedup for n, m in run.compared.items()}, title, out,
                                   spread={n: run.speedup_range(n) for n in run.compared}, name=f"speedup_{tag}")[1]
    with_cats = {n: m.by_category for n, m in run.compared.items() if m.by_category}
    if with_cats:
        cats = list(next(iter(with_cats.values())))
        speed = {n: [c[k].speedup for k in cats] + [run.methods[n].speedup] for n, c in with_cats.items()}
        written += figures.speedup_by_category(speed, cats + ["overall"], title, out,
                                               name=f"speedup_by_category_{run.experiment.replace('/', '_')}")[1]
    first = next(iter(run.methods[run.baseline].tokens), None)
    priced = [n for n, m in run.compared.items() if m.drafter.kind == "dytc_tree"]  # the trees with a cost model
    if priced and not (job.dir / "steps.jsonl").is_file():
        print(f"{job.dir}: no steps.jsonl, so no tree trajectories", file=sys.stderr)
        priced = []
    for name in priced:
        steps = [{"nodes": s["drafted"], "accepted": s["accepted"], "estimates": s["tree"]["estimates"]}
                 for s in job.steps() if s["method"] == name and s["prompt"] == first and s.get("tree")
                 and s["tree"]["estimates"].get("alpha")]
        if steps:
            written += figures.tree_trajectories(steps, f"{name}: {run.target}, {run.dataset}/{first}", out,
                                                 name=f"tree_trajectories_{name}_{run.dataset}")[1]
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a run directory (or a sweep: one set of figures per job)")
    ap.add_argument("--out", required=True, help="figure directory (PNG and PDF)")
    args = ap.parse_args(argv)
    jobs = complete_jobs(args.results)
    if not jobs:
        return 1
    for job in jobs:
        for p in plot_job(job, args.out):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
