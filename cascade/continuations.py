"""The target's own continuations of corpus prompts: training text for draft-head
self-distillation (the head learns on text the target itself writes, as in decoding).

``continuations(lm, new_tokens)`` yields, prompt by prompt (``cascade.data.continuation_prompts``:
outside the evaluation reserve; chat prompts in the target's chat template when it has one), the prompt's token ids followed by the target's greedy
continuation of up to ``new_tokens`` tokens (``cascade.generate`` with prompt lookup as the
drafter, or the drafter ``make_drafter`` builds, once, at the first prompt the cache lacks:
lossless either way, so the text is the target's greedy output and the cache does not depend on
the drafter; a prompt longer than the context keeps its last tokens). Lazy: a consumer that stops
after N tokens generates only those. Each continuation is appended to a JSONL cache (one line
per prompt, flushed) under ``<cascade cache>/continuations/``, keyed by the target and
``new_tokens``: an interrupted run loses at most the prompt being generated, and a rerun
generates only what the cache lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

from tqdm.auto import tqdm

from cascade.data import continuation_prompts, encode_prompt, has_chat_template
from cascade.decode import generate
from cascade.drafters.base import Drafter
from cascade.drafters.ngram import NGramDrafter
from cascade.models.lm import CausalLM
from cascade.models.zoo import cache_root

FORMAT = "cascade.continuations/1"


def cache_file(lm: CausalLM, new_tokens: int, root: Path | None = None) -> Path:
    return Path(root or cache_root() / "continuations") / f"{lm.name.replace('/', '_')}-greedy{new_tokens}.jsonl"


def _read(path: Path) -> dict[str, list[int]]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by an interruption: generated again
                continue
            if row.get("format") == FORMAT:
                done[row["id"]] = row["tokens"]
    return done


def continuations(lm: CausalLM, new_tokens: int = 128, root: Path | None = None, progress: bool = True, *,
                  make_drafter: Callable[[], Drafter] | None = None) -> Iterator[list[int]]:
    """Prompt + greedy continuation token ids, prompt by prompt (see the module docstring)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    drafter = None  # built at the first prompt to generate
    path = cache_file(lm, new_tokens, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read(path)
    has_chat = has_chat_template(lm)  # else raw text
    bar = tqdm(desc=f"{lm.name} continuations (new tokens)", unit="tok", disable=not progress)
    try:
        for p in continuation_prompts():
            if p.id not in done:
                ids = encode_prompt(lm, p.text, bool(p.chat) and has_chat)
                ids = ids[-(lm.max_context - new_tokens):]  # a prompt beyond the context keeps its end
                if drafter is None:
                    drafter = make_drafter() if make_drafter is not None else NGramDrafter(k=4)
                out = generate(lm, ids, drafter=drafter, max_new_tokens=new_tokens)
                done[p.id] = ids + out.tokens
                with open(path, "a") as f:
                    f.write(json.dumps({"format": FORMAT, "id": p.id, "prompt_len": len(ids), "tokens": done[p.id]}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                bar.update(len(out.tokens))
            yield done[p.id]
    finally:  # also when the consumer stops early
        bar.close()
