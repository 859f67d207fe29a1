"""Gather result directories (one run, or a whole multirun sweep) into rows.

``python -m cascade.results DIR`` prints one line per (job, method); incomplete jobs (no
``summary.json``: still running, crashed or interrupted) are listed, not silently dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def _overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    items = yaml.safe_load(path.read_text()) or []
    return dict(item.lstrip("+~").split("=", 1) for item in items if "=" in item)


def job_dirs(root: str | Path) -> list[Path]:
    """Directories under ``root`` that are Hydra jobs (hold ``.hydra/``) or hold a summary."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such result directory: {root}")
    found = {p.parent for p in root.rglob("summary.json")} | {p.parent for p in root.rglob(".hydra")}
    return sorted(found)


def gather(root: str | Path) -> tuple[list[dict], list[Path]]:
    """Rows (one per job and method) and the incomplete job directories."""
    rows, incomplete = [], []
    for job in job_dirs(root):
        path = job / "summary.json"
        if not path.is_file():
            incomplete.append(job)
            continue
        try:
            summary = json.loads(path.read_text())
            methods = summary["methods"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{path}: malformed summary ({exc})") from exc
        for name, m in methods.items():
            rows.append({
                "dir": str(job), "experiment": summary.get("experiment"), "method": name,
                **_overrides(job),
                **{k: m.get(k) for k in ("tau", "alpha", "tokens_per_s", "speedup")},
            })
    return rows, incomplete


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m cascade.results RESULT_DIR", file=sys.stderr)
        return 2
    rows, incomplete = gather(argv[0])
    for r in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "dir"))
    for job in incomplete:
        print(f"incomplete: {job}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
