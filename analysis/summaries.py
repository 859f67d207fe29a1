"""The run directories a command-line tool was given, each with its ``summary.json`` read."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path


def each_run(description: str, argv: list[str] | None = None) -> Iterator[tuple[Path, dict]]:
    """Parse ``RUN_DIR [RUN_DIR ...]`` (``description``: the tool's ``--help``) and yield each
    directory with its summary as JSON."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    for run in ap.parse_args(argv).runs:
        yield run, json.loads((run / "summary.json").read_text())
