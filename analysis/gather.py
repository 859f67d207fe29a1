"""Read one run directory or a whole Hydra multirun sweep into one pandas table.

One row per (job, method): the swept parameters (from the job's ``.hydra/overrides.yaml``) as
columns, then the method's summary numbers. Jobs are read by ``cascade.results.load_jobs`` (the
one reader): a job without ``summary.json`` is skipped and reported; a malformed file raises
``GatherError`` naming it.
"""

from __future__ import annotations

from pathlib import Path

import sys

import pandas as pd

from cascade.results import GatherError, Job, load_jobs  # noqa: F401  (re-exported for analysis users)

# Columns: formula_* and decomposed_* are in-sample (the run's own α and costs); predicted_speedup
# and measured_over_predicted are out of sample (the second half of the prompts, from the first)


def table(root: str | Path) -> tuple[pd.DataFrame, list[Path]]:
    """One row per (job, method) with swept parameters as columns; and the incomplete jobs."""
    jobs, incomplete = load_jobs(root)
    rows = []
    for job in jobs:
        run = job.summary
        for name, m in run.methods.items():
            d = m.decomposition
            h = m.heldout
            rows.append({
                "dir": str(job.dir), "experiment": run.experiment, "method": name, "target": run.target,
                "dataset": run.dataset, **job.params,
                "tau": m.tau, "alpha": m.alpha, "tokens_per_s": m.tokens_per_s, "speedup": m.speedup,
                "formula_speedup": d.formula_speedup, "formula_speedup_verify_cost": d.formula_speedup_verify_cost,
                "decomposed_speedup_per_depth": d.decomposed_speedup_per_depth,
                "predicted_speedup": None if h is None else h.predicted_speedup,
                "measured_over_predicted": None if h is None else h.measured_over_predicted,
                "overhead_frac": m.stats.overhead_frac,
                # per prompt category (dataset=mixed): speedup[CATEGORY] and tau[CATEGORY]
                **{f"{k}[{c}]": getattr(v, k) for c, v in (m.by_category or {}).items() for k in ("speedup", "tau")},
            })
    return pd.DataFrame(rows), incomplete


def complete_jobs(root: str | Path) -> list[Job]:
    """The complete jobs under ``root`` for a command-line tool: each incomplete job and an empty
    result are reported on stderr (the caller exits non-zero on an empty list)."""
    jobs, incomplete = load_jobs(root)
    for d in incomplete:
        print(f"skipped incomplete job: {d}", file=sys.stderr)
    if not jobs:
        print(f"no complete job under {root}", file=sys.stderr)
    return jobs
