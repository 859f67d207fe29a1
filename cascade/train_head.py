"""`python -m cascade.train_head [overrides]`: train an EAGLE-style draft head for the target.

1. corpus: chunks from ``train.sources`` (outside the evaluation reserve; ``cascade.head_training``);
2. features: the target's features of every chunk, cached under ``train.features_dir`` with a
   manifest (resumable: an interrupted capture continues where it stopped);
3. head (``train.recipe``): ``eagle``, cascade's single-feature head (``DraftHead.from_target``:
   the LM head's input f_t fused with the next token's embedding), or ``eagle3``, EAGLE-3's head
   (``Eagle3Head.from_target``: three layers' states fused by ``fc`` 3H -> H, its own LM head over
   the draft vocabulary, no feature regression), over the ``train.vocab`` token ids most frequent
   in the training chunks (FR-Spec; all ids when null), trained with AdamW on the unrolled loss
   (``train.unroll`` steps of EAGLE-3's training-time test), the checkpoint written atomically
   after every epoch with the held-out top-1 agreement at depths 1..4 (printed per epoch), and
   the run's progress (``train_state.pt``: head, optimiser, shuffle generator, history) beside it,
   so that the same command on the same run directory continues an interrupted run from its last
   finished epoch (``train.resume``);
4. ``summary.json`` and the checkpoint in the Hydra run directory (``head.pt``; for eagle3 the
   release directory ``head_eagle3/``), also copied to ``train.save_to`` (``auto``:
   ``models.head_path`` or ``models.eagle3_head_path``, where the draft-head methods load it).

``models.device=cuda`` trains on a GPU with the same code (written for it; not run on a GPU yet).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import hydra
import hydra.utils
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from cascade.drafters.base import Drafter
from cascade.head_training import (ContinuationSource, agreement, capture_features, chunk_loss, chunks_sha256,
                                   corpus_chunks)
from cascade.metrics import write_json_atomic
from cascade.models import load_model
from cascade.models.heads.checkpoints import load_checkpoint, save_checkpoint
from cascade.models.heads.eagle import DraftHead, HeadLayout
from cascade.models.heads.eagle3 import Eagle3Head, default_layers
from cascade.models.layers import decoder_parts, dense_weight
from cascade.models.backends.backend import cpu_has_native_bf16
from cascade.models.heads.pruned_head import rank_by_frequency
from cascade.models.zoo import cache_root
from cascade.run import ConfigError, _output_dir

log = logging.getLogger(__name__)


def _check(t) -> None:
    if not 0 < t.heldout_frac < 1:
        raise ConfigError(f"train.heldout_frac must lie in (0, 1), got {t.heldout_frac}")
    if t.unroll < 1 or t.epochs < 1:
        raise ConfigError(f"train.unroll and train.epochs must be >= 1, got {t.unroll}, {t.epochs}")
    if t.train_tokens is not None and t.train_tokens < 2:
        raise ConfigError(f"train.train_tokens must be >= 2 or null, got {t.train_tokens}")
    if t.vocab is not None and t.vocab < 1:
        raise ConfigError(f"train.vocab must be >= 1 or null, got {t.vocab}")
    if t.batch_chunks < 1:
        raise ConfigError(f"train.batch_chunks must be >= 1, got {t.batch_chunks}")
    if t.recipe not in RECIPES:
        raise ConfigError(f"train.recipe must be one of {RECIPES}, got {t.recipe!r}")
    if t.layers is not None and (t.recipe != "eagle3" or len(t.layers) < 1):
        raise ConfigError(f"train.layers (target layers an EAGLE-3 head reads) needs train.recipe=eagle3 and "
                          f"at least one layer, got {t.layers} with recipe {t.recipe!r}")
    if t.fusion not in ("concat", "normed"):
        raise ConfigError(f"train.fusion must be concat or normed, got {t.fusion!r}")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
    if t.continuation_tokens < 1:
        raise ConfigError(f"train.continuation_tokens must be >= 1, got {t.continuation_tokens}")
    if t.feature_storage not in FEATURE_STORAGE:
        raise ConfigError(f"train.feature_storage must be one of {sorted(FEATURE_STORAGE)}, got {t.feature_storage!r}")
    if t.resume not in RESUME:
        raise ConfigError(f"train.resume must be one of {RESUME}, got {t.resume!r}")


RECIPES = ("eagle", "eagle3")
RESUME = ("auto", True, False)
TRAIN_STATE_FORMAT = "cascade.head_train_state/1"
FEATURE_STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def training_autocast(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the head's training steps: ``bf16`` -> bfloat16; ``auto`` ->
    bfloat16 where the device multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX,
    where a bf16 matmul runs 2-3x fp32's rate), else None (fp32). Parameters, gradients and the
    optimiser's state stay fp32 either way; the loss's softmaxes run in fp32 (``chunk_loss``)."""
    if precision == "fp32":
        return None
    if precision == "bf16" or device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return None


def _lr(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _first_tokens(chunks: list, tokens: int) -> list:
    """The first chunks holding at least ``tokens`` tokens (or all)."""
    kept, count = [], 0
    for c in chunks:
        if count >= tokens:
            break
        kept.append(c)
        count += c.tokens.numel()
    return kept


def _head_vocab(lm, chunks: list, size: int | None) -> torch.Tensor | None:
    """The ``size`` ids most frequent in ``chunks`` plus EOS, sorted (None: the whole vocabulary)."""
    if size is None or size >= lm.vocab_size:
        return None
    keep = rank_by_frequency([c.tokens for c in chunks], lm.vocab_size)[:size].tolist()
    keep += [i for i in sorted(lm.eos_token_ids) if i not in set(keep) and i < lm.vocab_size]
    return torch.tensor(sorted(keep))


def _captured_layers(t, lm) -> tuple[int, ...]:
    """The target layers the head reads beside the final feature: none (eagle), EAGLE-3's."""
    if t.recipe != "eagle3":
        return ()
    return tuple(int(i) for i in (t.layers or default_layers(decoder_parts(lm).num_layers)))


def _new_head(t, lm, vocab, layers: tuple[int, ...], seed: int) -> DraftHead | Eagle3Head:
    if t.recipe == "eagle3":
        return Eagle3Head.from_target(lm, vocab, layers, seed=seed)
    return DraftHead.from_target(lm, vocab, seed=seed, layout=HeadLayout(t.fusion))


def _drafter_factory(node) -> Callable[[], Drafter] | None:
    """``train.continuation_drafter`` as a factory (the drafter is built only if a continuation
    must be generated): a drafter config (``_target_``), or None (prompt lookup)."""
    if node is None:
        return None
    if "_target_" not in node:
        raise ConfigError(f"train.continuation_drafter must be a drafter config with _target_ (or null), got {node}")
    return lambda: hydra.utils.instantiate(node)


def _save_path(t, models) -> Path | None:
    """Where the checkpoint is copied: ``train.save_to``; ``auto``: the recipe's default path."""
    if t.save_to == "auto":
        return Path(models.eagle3_head_path if t.recipe == "eagle3" else models.head_path).expanduser()
    return Path(t.save_to).expanduser() if t.save_to else None


@dataclass
class TrainProgress:
    """What a training run needs to continue exactly where its last finished epoch ended."""
    fingerprint: dict  # what fixes the run's result (``run_fingerprint``): a resumed run must match it
    epochs_done: int
    step: int  # optimiser steps taken
    train_s: float  # seconds in optimiser steps so far
    elapsed_s: float  # seconds since training began, evaluations included
    history: list[dict]  # one entry per finished epoch
    head: dict  # the head's state dict
    optimizer: dict  # AdamW's state dict
    order_rng: torch.Tensor  # the epoch-shuffle generator's state

    def save(self, path: Path) -> None:
        save_checkpoint({"format": TRAIN_STATE_FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}, path)

    @classmethod
    def load(cls, path: Path) -> "TrainProgress":
        payload = load_checkpoint(path, TRAIN_STATE_FORMAT, "head training state", "cascade.train_head")
        return cls(**{f.name: payload[f.name] for f in fields(cls)})


def run_fingerprint(cfg: DictConfig, features_dir: Path) -> dict:
    """The settings a run's result depends on: its training config, seed, target and backend, and
    the captured features' directory name (the target, layers and the chunks' sha256). Not: where
    the copy goes, whether to resume, where the features cache lies, which drafter generated the
    continuations (the same text whichever)."""
    train = {k: v for k, v in OmegaConf.to_container(cfg.train, resolve=True).items()
             if k not in ("save_to", "resume", "features_dir", "continuation_drafter")}
    return {"train": train, "seed": cfg.seed, "target": cfg.models.target, "backend": cfg.models.backend,
            "features": features_dir.name}


def _resumable(path: Path, fingerprint: dict, resume) -> TrainProgress | None:
    """The progress to continue from (``train.resume``): ``auto``, the run directory's own when it
    was made with the same settings (else a fresh start, logged); true, that or an error; false,
    none."""
    if resume is False or (resume == "auto" and not path.is_file()):
        return None
    if not path.is_file():
        raise ConfigError(f"train.resume=true but {path} does not exist (run the interrupted command with "
                          f"hydra.run.dir set to its run directory)")
    progress = TrainProgress.load(path)
    if progress.fingerprint != fingerprint:
        old, new = progress.fingerprint, fingerprint
        differ = sorted({k for k in old.get("train", {}) | new["train"] if old.get("train", {}).get(k) != new["train"].get(k)}
                        | {k for k in new if k != "train" and old.get(k) != new[k]})
        if resume is True:
            raise ConfigError(f"{path} is the progress of a run with other settings ({', '.join(differ)}); "
                              f"pass train.resume=false to start afresh")
        log.warning("%s holds a run with other settings (%s): starting afresh", path, ", ".join(differ))
        return None
    log.info("resuming from %s: %d of %d epochs done, %d steps", path, progress.epochs_done,
             fingerprint["train"]["epochs"], progress.step)
    return progress


def _train_epochs(head: DraftHead | Eagle3Head, lm, train_chunks: list, held: list, head_rows: torch.Tensor,
                  vocab: torch.Tensor | None, cfg: DictConfig, ckpt: Path, *, fingerprint: dict,
                  state_path: Path) -> list[dict]:
    """AdamW over ``train.epochs`` shuffled passes; after each, the held-out agreement (printed),
    the checkpoint and the run's progress (both atomic); a run whose progress is at
    ``state_path`` continues after its last finished epoch (``_resumable``), bitwise as if it had
    not stopped. Returns the per-epoch history."""
    t = cfg.train
    opt = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = math.ceil(len(train_chunks) / t.batch_chunks)  # optimiser steps per epoch
    total_steps = t.epochs * per_epoch
    warmup = t.warmup_steps if t.warmup_steps is not None else max(1, int(0.05 * total_steps))
    history, step, start_epoch = [], 0, 0
    train_s = 0.0  # seconds in optimiser steps (the held-out evaluations excluded)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()
    resumed = _resumable(state_path, fingerprint, t.resume)
    if resumed is not None:
        head.load_state_dict(resumed.head)
        opt.load_state_dict(resumed.optimizer)
        gen.set_state(resumed.order_rng)
        history, step, start_epoch, train_s = list(resumed.history), resumed.step, resumed.epochs_done, resumed.train_s
        t0 -= resumed.elapsed_s
    bar = tqdm(total=total_steps, initial=step, desc="train head", disable=not cfg.progress)
    device = head.fc.weight.device
    autocast = training_autocast(t.precision, device)
    log.info("training steps in %s", "fp32" if autocast is None else f"{autocast} autocast")
    for epoch in range(start_epoch, t.epochs):
        head.train()
        epoch_t0 = time.perf_counter()
        loss_sum, train_hits = 0.0, []
        order = torch.randperm(len(train_chunks), generator=gen).tolist()
        for first in range(0, len(order), t.batch_chunks):  # one optimiser step per batch of chunks
            batch = order[first:first + t.batch_chunks]
            for group in opt.param_groups:
                group["lr"] = _lr(step, total_steps, t.lr, warmup)
            opt.zero_grad()
            for i in batch:
                with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                    loss, hits = chunk_loss(head, lm, train_chunks[i], head_rows, t.unroll, t.feature_weight, t.ce_weight)
                (loss / len(batch)).backward()
                loss_sum += loss.item()
                train_hits.append(hits[0])
            torch.nn.utils.clip_grad_norm_(head.parameters(), t.clip)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", top1=f"{hits[0]:.2f}")
        train_s += time.perf_counter() - epoch_t0
        head.eval()  # held-out agreement in the head's own precision, as decoding runs it
        agree = agreement(head, lm, held, head_rows, vocab)
        history.append({"epoch": epoch, "steps": step, "loss": loss_sum / len(train_chunks), "agreement": agree,
                        "train_top1": sum(train_hits) / len(train_hits),  # depth 1, on the chunks as trained
                        "elapsed_s": time.perf_counter() - t0,
                        "train_tokens_per_s": sum(c.tokens.numel() for c in train_chunks) * (epoch + 1) / train_s})
        print(f"epoch {epoch} ({step} steps, {history[-1]['train_tokens_per_s']:.0f} training tokens/s): "
              f"loss {history[-1]['loss']:.3f}, training-set top-1 (depth 1) "
              f"{history[-1]['train_top1']:.3f}, held-out top-1 agreement at depths 1-4: "
              + " ".join(f"{a:.3f}" for a in agree), flush=True)
        head.save(ckpt, metrics={"epochs_done": epoch + 1, "history": history})  # nothing lost on interruption
        TrainProgress(fingerprint, epoch + 1, step, train_s, time.perf_counter() - t0, history, head.state_dict(),
                      opt.state_dict(), gen.get_state()).save(state_path)
    bar.close()
    return history


def train(cfg: DictConfig) -> dict:
    """Capture, train, evaluate and save; returns the summary written to ``summary.json``."""
    t = cfg.train
    _check(t)
    out_dir = _output_dir(cfg)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    m = cfg.models
    lm = load_model(m.target, m.backend, m.device)
    for p in lm.model.parameters():  # the target is frozen: no gradient for its embedding or head
        p.requires_grad_(False)
    sources = dict(t.sources)

    t0 = time.perf_counter()
    continuation = ContinuationSource(t.continuation_tokens, _drafter_factory(t.continuation_drafter))
    token_chunks = corpus_chunks(lm, sources, t.seq_len, t.max_tokens, cfg.seed, continuation, cfg.progress)
    if len(token_chunks) < 2:
        raise ConfigError(f"only {len(token_chunks)} chunk(s) of text: raise train.max_tokens")
    features_root = Path(t.features_dir or cache_root() / "head_features").expanduser()
    prefix = lm.name.replace('/', '_')
    layers = _captured_layers(t, lm)  # (EAGLE-3's capture, the layers' states and the final feature, has its own directory)
    layers_tag = f"l{'-'.join(map(str, layers))}-" if layers else ""
    features_dir = features_root / f"{prefix}-{layers_tag}{chunks_sha256(token_chunks)[:16]}"
    chunks = capture_features(lm, token_chunks, sources, t.seq_len, features_dir, cfg.progress,
                              FEATURE_STORAGE[t.feature_storage], reuse_dirs=sorted(features_root.glob(f"{prefix}-*")),
                              layers=layers)
    feature_s = time.perf_counter() - t0
    n_held = max(1, round(len(chunks) * t.heldout_frac))
    train_chunks, held = chunks[:-n_held], chunks[-n_held:]
    if t.train_tokens is not None:  # a smaller training set from the same captured features
        train_chunks = _first_tokens(train_chunks, t.train_tokens)
    vocab = _head_vocab(lm, train_chunks, t.vocab)
    head = _new_head(t, lm, vocab, layers, cfg.seed).to(lm.device)
    if not head.predicts_features:
        log.info("recipe %s: no feature regression (train.feature_weight unused)", t.recipe)
    head_w = dense_weight(decoder_parts(lm).head)  # [V, H]
    head_rows = (head_w if vocab is None else head_w[vocab]).to(lm.device)  # [|S|, H]
    del head_w
    agree_init = agreement(head, lm, held, head_rows, vocab)
    log.info("held-out top-1 agreement at depths 1-4 before training: %s", [round(a, 3) for a in agree_init])

    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / ("head_eagle3" if t.recipe == "eagle3" else "head.pt")
    t1 = time.perf_counter()
    history = _train_epochs(head, lm, train_chunks, held, head_rows, vocab, cfg, ckpt,
                            fingerprint=run_fingerprint(cfg, features_dir), state_path=out_dir / "train_state.pt")
    metrics = {
        "target": lm.name, "sources": sources, "features_dir": str(features_dir),
        "train_tokens": sum(c.tokens.numel() for c in train_chunks), "heldout_tokens": sum(c.tokens.numel() for c in held),
        "vocab": None if vocab is None else int(vocab.numel()), "unroll": t.unroll, "epochs": t.epochs,
        "recipe": t.recipe, "layers": list(layers), "fusion": t.fusion if t.recipe == "eagle" else None, "batch_chunks": t.batch_chunks, "steps": history[-1]["steps"],
        "precision": "fp32" if training_autocast(t.precision, lm.device) is None else "bf16",
        "feature_storage": t.feature_storage,
        "agreement_init": agree_init, "agreement": history[-1]["agreement"], "history": history,
        "feature_time_s": feature_s, "train_time_s": time.perf_counter() - t1,
    }
    head.save(ckpt, metrics=metrics)
    save_to = _save_path(t, m)
    if save_to:
        head.save(save_to, metrics=metrics)
    summary = {"config": OmegaConf.to_container(cfg, resolve=True), "metrics": metrics, "checkpoint": str(ckpt)}
    write_json_atomic(out_dir / "summary.json", summary)
    print(f"draft head for {lm.name}: {metrics['train_tokens']} training tokens, {t.epochs} epochs, unroll {t.unroll}, "
          f"vocab {metrics['vocab'] or lm.vocab_size}; held-out top-1 agreement at depths 1-4 "
          + " ".join(f"{a:.3f}" for a in metrics["agreement"])
          + f" (untrained: {' '.join(f'{a:.3f}' for a in agree_init)})\ncheckpoint: {ckpt}"
          + (f" (copied to {save_to})" if save_to else ""))
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_head")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
