"""Read one run directory or a whole Hydra multirun sweep into one pandas table.

One row per (job, method): the swept parameters (from the job's ``.hydra/overrides.yaml``) as
columns, then the method's summary numbers. Jobs are read by ``cascade.results.load_jobs`` (the
one reader): a job without ``summary.json`` is skipped and reported; a malformed file raises
``GatherError`` naming it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from cascade.results import GatherError, Job, load_jobs  # noqa: F401  (re-exported for analysis users)

# formula_* and decomposed_* are in-sample (the run's own α and costs); predicted_speedup and
# measured_over_predicted are out of sample (the second half of the prompts, from the first)
COLUMNS = ("tau", "alpha", "tokens_per_s", "speedup", "formula_speedup", "formula_speedup_verify_cost",
           "decomposed_speedup_per_depth", "predicted_speedup", "measured_over_predicted", "overhead_frac")


def table(root: str | Path) -> tuple[pd.DataFrame, list[Path]]:
    """One row per (job, method) with swept parameters as columns; and the incomplete jobs."""
    jobs, incomplete = load_jobs(root)
    rows = []
    for job in jobs:
        cfg = job.summary["config"]
        for name, m in job.summary["methods"].items():
            for key in ("tau", "tokens_per_s", "speedup"):
                if key not in m:
                    raise GatherError(f"{job.dir / 'summary.json'}: method {name!r} lacks {key!r}")
            rows.append({
                "dir": str(job.dir), "experiment": job.summary.get("experiment"), "method": name,
                "target": cfg.get("models", {}).get("target"), "dataset": cfg.get("dataset", {}).get("name"),
                **job.params, **{k: m.get(k) for k in COLUMNS},
                # per prompt category (dataset=mixed): speedup[CATEGORY] and tau[CATEGORY]
                **{f"{k}[{c}]": v[k] for c, v in (m.get("by_category") or {}).items() for k in ("speedup", "tau")},
            })
    return pd.DataFrame(rows), incomplete
