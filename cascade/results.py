"""Read result directories (one run, or a whole multirun sweep): the one job reader.

``load_jobs(root)`` returns the complete jobs (``Job``: directory, the typed
:class:`~cascade.summary.RunSummary`, swept parameters from ``.hydra/overrides.yaml``, per-step
records on demand) and the incomplete job directories
(no ``summary.json``: still running, crashed or interrupted), which are listed, not silently
dropped. A malformed file raises ``GatherError`` naming it (and the line, for ``steps.jsonl``).
``analysis.gather`` builds its pandas table on this.

``python -m cascade.results DIR`` prints each run's provenance line (``Environment.header``),
then one line per (job, method).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cascade.summary import RunSummary
from cascade.types import DrafterInfo


class GatherError(ValueError):
    """A result file is missing a required field or is not valid JSON / YAML."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GatherError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc


def overrides(job: Path) -> dict[str, str]:
    """The job's swept parameters (Hydra overrides), without the experiment/debug selectors and the
    switches that do not change what a job measures (resume, progress)."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    try:
        items = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as exc:
        raise GatherError(f"{path}: not valid YAML ({exc})") from exc
    return {k.lstrip("+~"): v for k, v in (item.split("=", 1) for item in items if "=" in item)
            if k.lstrip("+~") not in ("experiment", "debug", "resume", "progress")}


def job_dirs(root: str | Path) -> list[Path]:
    """Directories under ``root`` that are Hydra jobs (hold ``.hydra/``) or hold a summary."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such result directory: {root}")
    found = {p.parent for p in root.rglob("summary.json")} | {p.parent for p in root.rglob(".hydra")}
    return sorted(found)


@dataclass
class Job:
    dir: Path
    summary: RunSummary
    params: dict
    _steps: list[dict] | None = field(default=None, repr=False)

    def drafter(self, method: str) -> DrafterInfo:
        """What ``method`` is (``Drafter.describe`` as written by the run)."""
        return self.summary.methods[method].drafter

    def steps(self) -> list[dict]:
        """The per-step records (``steps.jsonl``), read once."""
        if self._steps is None:
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
            self._steps = rows
        return self._steps


def load_jobs(root: str | Path) -> tuple[list[Job], list[Path]]:
    """Complete jobs under ``root`` and the incomplete job directories."""
    jobs, incomplete = [], []
    for d in job_dirs(root):
        path = d / "summary.json"
        if not path.is_file():
            incomplete.append(d)
            continue
        try:
            summary = RunSummary.from_dict(_read_json(path))
        except (KeyError, TypeError) as exc:
            raise GatherError(f"{path}: malformed summary ({exc}; written by an older cascade? rerun it)") from exc
        jobs.append(Job(d, summary, overrides(d)))
    return jobs, incomplete


def gather(root: str | Path) -> tuple[list[dict], list[Path]]:
    """Rows (one per job and method) and the incomplete job directories."""
    jobs, incomplete = load_jobs(root)
    rows = [
        {"dir": str(job.dir), "experiment": job.summary.experiment, "method": name, **job.params,
         "tau": m.tau, "alpha": m.alpha, "tokens_per_s": m.tokens_per_s, "speedup": m.speedup}
        for job in jobs for name, m in job.summary.methods.items()
    ]
    return rows, incomplete


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m cascade.results RESULT_DIR", file=sys.stderr)
        return 2
    jobs, incomplete = load_jobs(argv[0])
    rows, _ = gather(argv[0])
    for job in jobs:
        print(f"{job.dir}: {job.summary.environment.header()}")
    for r in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "dir"))
    for job in incomplete:
        print(f"incomplete: {job}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
