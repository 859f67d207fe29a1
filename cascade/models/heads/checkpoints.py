"""Checkpoint files of trained drafter parts (Kangaroo adapters, draft heads): ``torch.save`` dicts
with a ``format`` tag, written atomically and read back with the tag checked."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_checkpoint(payload: dict, path: str | Path) -> Path:
    """Write ``payload`` to ``path`` atomically: an interrupted save never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path, fmt: str, what: str, command: str, error: type[Exception] = ValueError) -> dict:
    """The payload at ``path``; FileNotFoundError (naming the training ``command``) when it is
    missing, ``error`` when it is not a ``what`` checkpoint of format ``fmt``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} checkpoint {path} does not exist (train one with python -m {command})")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        raise error(f"{path} is not a cascade {what} checkpoint")
    return payload
