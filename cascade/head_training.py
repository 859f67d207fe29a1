"""Draft-head training data and math: the corpus plan, cached target features, the unrolled loss.

1. ``corpus_chunks``: token chunks (at most ``seq_len`` tokens, never mixing two texts) from named
   sources, each source a share of ``max_tokens``: plain corpora (``cascade.data.corpus``) and
   question sets (``cascade.data.qa_pairs``, in the target's chat template when it has one), and
   the target's own greedy continuations of corpus prompts (``continuations``: self-distillation
   text, ``cascade.continuations``). Every source lies outside the evaluation reserve.
2. ``capture_features``: one target forward per chunk (``CausalLM.forward(...,
   return_hidden=FINAL_HIDDEN)``, the forward the decode loop runs, so the features are the ones
   a drafter is handed; an EAGLE-3 head's three layers and the final feature in the same forward),
   written one file per chunk into a directory with a manifest (target, captured layers, sources,
   sha256 of the chunks, token count): resumable, and reused by any later training on the same
   target, layers and chunks; a larger corpus whose chunks include a smaller one's copies the
   smaller one's files (``reuse_dirs``) instead of recomputing them.
3. ``unroll`` / ``chunk_loss``: EAGLE's training with EAGLE-3's "training-time test". Step 1 feeds
   the target's features f_t with tokens x_{t+1}; step s feeds step s-1's predicted features
   (the head's own, as when drafting s tokens deep), and its queries see exactly what a draft at
   depth s sees: the head's cache entries of the target's features up to the draft's root, then
   the entries of steps 2..s along the draft (``unroll_mask``). Loss per step: cross-entropy
   against the target's own distribution over the head's vocabulary (self-distillation) plus,
   for a head whose outputs are predicted target features (``predicts_features``: not EAGLE-3's),
   ``feature_weight`` x smooth-L1 between predicted and target features (EAGLE's regression).
4. ``agreement``: held-out top-1 agreement with the target's greedy token (over the full
   vocabulary) at draft depths 1..d, the tokens before each position being the corpus's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

from cascade.continuations import continuations
from cascade.data import CONTINUATIONS, QA_SETS, corpus, has_chat_template, qa_pairs
from cascade.drafters.base import Drafter
from cascade.models.heads.eagle import DraftHead
from cascade.models.layers import decoder_parts
from cascade.metrics import Top1Agreement
from cascade.models.lm import FINAL_HIDDEN, CausalLM

FEATURES_FORMAT = "cascade.head_features/1"


@dataclass
class Chunk:
    tokens: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, F] what the head reads at step 1: the target's LM-head inputs (F = H) or layers' states (3H)
    final: torch.Tensor | None = None  # [T, H] the LM-head inputs when ``features`` are other layers' (the teacher's)

    @property
    def teacher(self) -> torch.Tensor:
        """[T, H] the target's LM-head inputs: its distribution at every position."""
        return self.features if self.final is None else self.final


@dataclass(frozen=True)
class ContinuationSource:
    """How the ``continuations`` source is generated (``cascade.continuations``): new tokens per
    prompt, and the drafter that speeds it up (built once, when a prompt is not cached yet;
    None: prompt lookup). The text is the target's greedy output whichever drafter runs."""
    new_tokens: int = 128
    make_drafter: Callable[[], Drafter] | None = None


@dataclass
class FeatureManifest:
    format: str
    target: str
    layers: list[int]  # captured layers beside the final feature ([]: the final feature only)
    sources: dict[str, float]
    seq_len: int
    chunks: int
    tokens: int
    sha256: str  # of the chunks' token ids: which text the features were captured on


def _source_texts(lm: CausalLM, name: str, continuation: ContinuationSource, progress: bool) -> Iterable[list[int]]:
    if name == CONTINUATIONS:  # lazy: generated only as far as the source's budget reaches
        return continuations(lm, continuation.new_tokens, progress=progress, make_drafter=continuation.make_drafter)
    if name in QA_SETS:
        chat = has_chat_template(lm)
        out = []
        for question, answer in qa_pairs(name):
            if chat:
                turns = [{"role": "user", "content": question}] + ([{"role": "assistant", "content": answer}] if answer else [])
                text = lm.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=not answer)
            else:
                text = question + "\n" + answer
            out.append(lm.encode(text))
        return out
    return [lm.encode(t) for t in corpus(name)]


def corpus_chunks(lm: CausalLM, sources: dict[str, float], seq_len: int, max_tokens: int, seed: int = 0,
                  continuation: ContinuationSource = ContinuationSource(), progress: bool = True) -> list[list[int]]:
    """Chunks of at most ``seq_len`` tokens (at least 2), each source ``name`` contributing up to
    ``share * max_tokens`` tokens from its texts in order; shuffled (seeded) so that a held-out
    tail holds every source. Source ``continuations``: corpus prompts followed by the target's
    greedy continuations (``continuation``; ``cascade.continuations``)."""
    if seq_len < 2 or max_tokens < 2:
        raise ValueError(f"seq_len and max_tokens must be >= 2, got {seq_len}, {max_tokens}")
    total_share = sum(sources.values())
    if not sources or total_share <= 0 or any(v < 0 for v in sources.values()):
        raise ValueError(f"sources must map source names to non-negative shares, got {sources}")
    chunks = []
    for name, share in sources.items():
        budget = int(max_tokens * share / total_share)
        if budget < 2:
            continue
        for ids in _source_texts(lm, name, continuation, progress):
            for start in range(0, len(ids) - 1, seq_len):
                piece = ids[start : start + seq_len][:budget]
                if len(piece) >= 2:
                    chunks.append(piece)
                    budget -= len(piece)
                if budget < 2:
                    break
            if budget < 2:
                break
    random.Random(seed).shuffle(chunks)
    return chunks


def chunks_sha256(chunks: list[list[int]]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(json.dumps(c).encode())
    return h.hexdigest()


def target_features(lm: CausalLM, tokens: list[int], layers: tuple[int, ...] = ()) -> torch.Tensor:
    """[T, (len(layers) + 1) * H] the states after each of ``layers`` (none by default), then the
    LM head's input (the final feature), at every position of ``tokens``: one forward, no LM-head
    rows but the last; a normal tensor (copied out of the forward's inference mode) that training
    can use."""
    _, feats = lm.forward(tokens, lm.new_cache(), keep_last=1, return_hidden=(*layers, FINAL_HIDDEN))
    return feats.clone()


def _chunk(saved: dict, storage: torch.dtype) -> Chunk:
    final = saved.get("final")
    return Chunk(saved["tokens"], saved["features"].to(storage), None if final is None else final.to(storage))


def _captured_chunks(dirs: list[Path], target: str, layers: list[int]) -> dict[str, Path]:
    """Chunk files of ``target``'s earlier captures of ``layers`` in ``dirs``, by the sha256 of their tokens."""
    found = {}
    for d in dirs:
        manifest = d / "manifest.json"
        if not manifest.is_file():
            continue
        old = json.loads(manifest.read_text())
        if old.get("target") != target or old.get("layers", []) != layers:
            continue
        for f in sorted(d.glob("chunk_*.pt")):
            tokens = torch.load(f, weights_only=True, mmap=True)["tokens"]  # mapped: the features are not read
            found.setdefault(chunks_sha256([tokens.tolist()]), f)
    return found


def capture_features(lm: CausalLM, chunks: list[list[int]], sources: dict[str, float], seq_len: int, out_dir: Path,
                     progress: bool = True, storage: torch.dtype = torch.float32,
                     reuse_dirs: list[Path] = (), layers: tuple[int, ...] = ()) -> list[Chunk]:
    """Features of every chunk, cached in ``out_dir`` (one file per chunk, written atomically; a
    rerun computes only the missing ones). Refuses a directory whose manifest names other chunks,
    another target or other layers. ``layers``: target layers whose states are the head's
    features (EAGLE-3's three; the final feature is then kept apart as the teacher's); none: the
    final feature is both. ``storage``: the dtype features are written and held in (float16 halves
    disk and memory; a file written in another dtype is rounded to it on load, which equals what
    a fresh capture in ``storage`` writes, so a cache made in float32 serves every storage).
    ``reuse_dirs``: earlier captures of the same target (other corpora); a chunk with the same
    tokens there is copied, not recomputed (features depend only on the target and the tokens)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = FeatureManifest(FEATURES_FORMAT, lm.name, list(layers), dict(sources), seq_len, len(chunks),
                               sum(map(len, chunks)), chunks_sha256(chunks))
    path = out_dir / "manifest.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if (old.get("target"), old.get("sha256"), old.get("layers", [])) != (manifest.target, manifest.sha256, manifest.layers):
            raise ValueError(f"{out_dir} holds features of another target, corpus or layers ({old.get('target')}, "
                             f"{old.get('sha256')}, layers {old.get('layers', [])})")
    path.write_text(json.dumps(asdict(manifest), indent=1))
    out, earlier, reused = [], None, 0
    bar = tqdm(total=manifest.tokens, desc="target features", unit="tok", disable=not progress)
    for i, ids in enumerate(chunks):
        f = out_dir / f"chunk_{i:05d}.pt"
        saved = torch.load(f, weights_only=True) if f.is_file() else None
        if saved is None or saved["tokens"].tolist() != ids:
            if earlier is None:  # indexed once, at the first chunk this directory lacks
                earlier = _captured_chunks([d for d in reuse_dirs if Path(d).resolve() != out_dir.resolve()], lm.name,
                                           manifest.layers)
            source = earlier.get(chunks_sha256([ids]))
            tmp = f.with_name(f.name + f".tmp{os.getpid()}")
            if source is not None:  # the file itself, copied (not re-serialised)
                shutil.copyfile(source, tmp)
                saved = torch.load(tmp, weights_only=True)
                reused += 1
            else:
                feats = target_features(lm, ids, layers).cpu().to(storage)  # [T, (len(layers) + 1) * H]
                saved = {"tokens": torch.tensor(ids), "features": feats}
                if layers:
                    hidden = feats.shape[-1] // (len(layers) + 1)
                    saved = {**saved, "features": feats[:, :-hidden].clone(), "final": feats[:, -hidden:].clone()}
                torch.save(saved, tmp)
            os.replace(tmp, f)
        out.append(_chunk(saved, storage))
        bar.update(len(ids))
    bar.close()
    if reused:
        print(f"features: {reused} of {len(chunks)} chunks copied from earlier captures", flush=True)
    return out


def unroll_mask(n: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, step * n] 0 / -inf: step ``step``'s query at head position u sees the entries of
    step 1 (the target's features) at positions <= u - step + 1 and the entry of step j at
    position u - (step - j) for j = 2..step: a draft ``step`` deep from the root u - step + 1."""
    allowed = torch.zeros(n, step * n, dtype=torch.bool)
    u = torch.arange(n)
    allowed[:, :n] = torch.arange(n)[None, :] <= (u[:, None] - step + 1)
    for j in range(2, step + 1):
        v = u - (step - j)
        ok = v >= 0
        allowed[u[ok], (j - 1) * n + v[ok]] = True
    mask = torch.zeros(n, step * n, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return mask[None, None]


def unroll(head: DraftHead, lm: CausalLM, chunk: Chunk, steps: int) -> list[torch.Tensor]:
    """The head's outputs at steps 1..``steps``, each [T-1, H]: row u of step s is its prediction
    of f_{u+1} (or, for EAGLE-3, its state there) from a draft s deep (see the module
    docstring). ``head``: a ``DraftHead`` or an ``Eagle3Head``."""
    n = chunk.tokens.numel() - 1
    positions = torch.arange(n)
    tokens = chunk.tokens[1:]  # x_{u+1}
    feats = chunk.features.to(head.fc.weight.device, head.fc.weight.dtype)
    cache = head.new_cache() if steps > 1 else None
    inputs, outs = feats[:n], []
    for s in range(1, steps + 1):
        mask = None if s == 1 else unroll_mask(n, s, feats.dtype)
        out = head(lm, inputs, tokens, positions, cache, mask)  # [n, H]
        outs.append(out)
        # step s+1 at u is fed step s's output at u - 1; row 0 has none (its root would be u = -1:
        # no loss reads it, and no valid row's query sees it), so it repeats out[0]
        inputs = torch.cat([out[:1], out[:-1]])
    return outs


def chunk_loss(head: DraftHead, lm: CausalLM, chunk: Chunk, head_rows: torch.Tensor, steps: int,
               feature_weight: float, ce_weight: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """Summed loss over the unrolled steps (``ce_weight`` x cross-entropy + ``feature_weight`` x
    smooth-L1 per step where the head predicts features) and each step's top-1 agreement with the
    teacher on the head's vocabulary. ``head_rows``: [|S|, H] the target's LM-head rows of the
    head's vocabulary (sorted ids, the order of the head's own logits)."""
    feats = chunk.teacher.to(head_rows.device, head_rows.dtype)  # [T, H] the target's LM-head inputs
    with torch.no_grad(), torch.autocast(feats.device.type, enabled=False):  # the teacher in full precision
        teacher = torch.softmax(feats[1:] @ head_rows.T, -1)  # [n, |S|] the target's distribution over S
    total, hits = torch.zeros((), device=feats.device), []
    for s, out in enumerate(unroll(head, lm, chunk, steps), start=1):
        valid = slice(s - 1, None)  # a draft s deep needs a root at u - s + 1 >= 0
        if out[valid].shape[0] == 0:  # a chunk too short for this depth
            break
        # under bf16 autocast the matmul runs in bf16; the softmax and the losses in fp32
        student = torch.log_softmax(head.train_logits(out[valid], head_rows).float(), -1)  # [n', |S|]
        ce = -(teacher[valid] * student).sum(-1).mean()
        total = total + ce_weight * ce
        if head.predicts_features:
            total = total + feature_weight * torch.nn.functional.smooth_l1_loss(out[valid].float(), feats[1:][valid])
        hits.append(float((student.argmax(-1) == teacher[valid].argmax(-1)).float().mean()))
    return total, hits


@torch.no_grad()
def agreement(head: DraftHead, lm: CausalLM, chunks: list[Chunk], head_rows: torch.Tensor, vocab: torch.Tensor | None,
              depths: int = 4) -> list[float]:
    """Top-1 agreement with the target's greedy token (full vocabulary) at draft depths 1..``depths``."""
    agree = [Top1Agreement() for _ in range(depths)]
    target_head = decoder_parts(lm).head
    for c in chunks:
        want = target_head(c.teacher.to(lm.device, lm.dtype)).argmax(-1)[1:]  # [n] the target's argmax at u+1
        for d, out in enumerate(unroll(head, lm, c, depths)):
            got = head.train_logits(out[d:], head_rows).argmax(-1)
            agree[d].add(vocab.to(got.device)[got] if vocab is not None else got, want[d:])
    return [a.rate for a in agree]
