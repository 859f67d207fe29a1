"""Read one run directory or a whole Hydra multirun sweep into one pandas table.

One row per (job, method): the swept parameters (from the job's ``.hydra/overrides.yaml``) as
columns, then the method's summary numbers. A job without ``summary.json`` (running, crashed,
interrupted) is skipped and reported; a malformed file raises ``GatherError`` naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

COLUMNS = ("tau", "alpha", "tokens_per_s", "speedup", "predicted_speedup", "predicted_speedup_verify_cost",
           "predicted_speedup_per_depth", "measured_over_predicted", "overhead_frac")


class GatherError(ValueError):
    """A result file is missing a required field or is not valid JSON / YAML."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GatherError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc


def overrides(job: Path) -> dict[str, str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    try:
        items = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as exc:
        raise GatherError(f"{path}: not valid YAML ({exc})") from exc
    return {k.lstrip("+~"): v for k, v in (item.split("=", 1) for item in items if "=" in item)
            if k.lstrip("+~") not in ("experiment", "debug")}


def job_dirs(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such result directory: {root}")
    found = {p.parent for p in root.rglob("summary.json")} | {p.parent for p in root.rglob(".hydra")}
    return sorted(found)


@dataclass
class Job:
    dir: Path
    summary: dict
    params: dict

    def steps(self) -> list[dict]:
        """The per-step records (``steps.jsonl``)."""
        path = self.dir / "steps.jsonl"
        if not path.is_file():
            raise GatherError(f"{path}: missing (the run's per-step records)")
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise GatherError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        return rows


def load_jobs(root: str | Path) -> tuple[list[Job], list[Path]]:
    """Complete jobs under ``root`` and the incomplete job directories."""
    jobs, incomplete = [], []
    for d in job_dirs(root):
        path = d / "summary.json"
        if not path.is_file():
            incomplete.append(d)
            continue
        summary = _read_json(path)
        for key in ("methods", "config", "baseline"):
            if key not in summary:
                raise GatherError(f"{path}: malformed summary (no {key!r})")
        jobs.append(Job(d, summary, overrides(d)))
    return jobs, incomplete


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
            })
    return pd.DataFrame(rows), incomplete
