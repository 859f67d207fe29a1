"""`python -m cascade.train_adapter [overrides]`: train a Kangaroo exit adapter by self-distillation.

The adapter (``cascade.models.heads.adapter.ExitAdapter``: one attention layer and two norms on top of
the target's layer ``exit_layer``, feeding the target's LM head) learns the target's own
next-token distribution on a text set:

1. features: one target forward per chunk of ``seq_len`` tokens (no gradients) keeps the exit
   hidden states [T, H] and the final normed hidden states [T, H]; the target's top
   ``vocab_topk`` tokens at every position form the training vocabulary S;
2. training: KL(target || adapter) over S (the target's logits restricted to S are exact; the
   restriction makes each step cost |S| instead of V head rows, which is what makes CPU
   training take minutes: V = 151,936 for Qwen), AdamW, ``epochs`` passes over the chunks;
3. evaluation on held-out chunks, over the full vocabulary: top-1 agreement with the target
   (the greedy acceptance rate of a one-token draft) of the plain early exit, the adapter at
   initialisation, and the trained adapter.

Writes ``adapter.pt`` (after every epoch, atomically; loadable with
``LayerSkipDrafter(exit_layer, adapter=PATH)`` or ``method.drafter.adapter=PATH``) and
``summary.json`` into the Hydra run directory, and copies the checkpoint to ``save_to`` if set.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from cascade.data import load_prompts
from cascade.metrics import Top1Agreement, write_json_atomic
from cascade.models import load_model
from cascade.models.heads.adapter import ExitAdapter
from cascade.models.layers import decoder_parts, dense_weight
from cascade.run import ConfigError, _output_dir

log = logging.getLogger(__name__)


@torch.no_grad()  # not inference_mode: the features feed the adapter's autograd graph
def collect_features(lm, texts: list[str], exit_layer: int, seq_len: int, max_tokens: int) -> list[dict]:
    """Chunks of at most ``seq_len`` tokens (texts are not mixed within a chunk), up to
    ``max_tokens`` in all: exit hidden states ``h_exit`` [T, H] and final normed ``h_final`` [T, H]."""
    chunks, total = [], 0
    for text in texts:
        ids = lm.encode(text)
        for start in range(0, len(ids) - 1, seq_len):
            piece = ids[start : start + seq_len]
            piece = piece[: max_tokens - total]
            if len(piece) < 2:
                break
            x = torch.tensor([piece], device=lm.device)
            out = lm.model(input_ids=x, output_hidden_states=True)
            chunks.append({
                "h_exit": out.hidden_states[exit_layer][0].float().cpu(),  # [T, H]
                "h_final": out.hidden_states[-1][0].float().cpu(),  # [T, H], after the final norm
            })
            total += len(piece)
        if total >= max_tokens:
            break
    return chunks


def training_vocab(chunks: list[dict], head_w: torch.Tensor, topk: int) -> torch.Tensor:
    """Union of the target's top-``topk`` tokens over all positions: [|S|] sorted ids."""
    ids = set()
    for c in chunks:
        logits = c["h_final"] @ head_w.T  # [T, V]
        ids.update(torch.topk(logits, topk, -1).indices.unique().tolist())
    return torch.tensor(sorted(ids))


def agreement(lm, adapter: ExitAdapter | None, chunks: list[dict], head_w: torch.Tensor) -> float:
    """Full-vocabulary top-1 agreement with the target on ``chunks`` (plain exit when adapter is None)."""
    norm = decoder_parts(lm).norm
    agree = Top1Agreement()
    with torch.no_grad():
        for c in chunks:
            h = c["h_exit"]
            if adapter is None:
                out = norm(h.to(lm.dtype)).float()  # the plain early exit: final norm + head
            else:
                out = adapter(lm, h, torch.arange(h.shape[0])).float()
            agree.add((out @ head_w.T).argmax(-1), (c["h_final"] @ head_w.T).argmax(-1))
    return agree.rate


def _fit(adapter: ExitAdapter, lm, train_chunks: list, w_s: torch.Tensor, t, ckpt: Path, progress: bool) -> list[float]:
    """The adapter's epochs (KL to the final layer's distribution over the training vocabulary),
    saved after each (nothing lost on interruption); the mean loss per epoch."""
    opt = torch.optim.AdamW(adapter.parameters(), lr=t.lr, weight_decay=0.0)
    losses = []
    bar = tqdm(total=t.epochs * len(train_chunks), desc="train adapter", disable=not progress)
    for epoch in range(t.epochs):
        total = 0.0
        for i in torch.randperm(len(train_chunks)).tolist():
            c = train_chunks[i]
            h = c["h_exit"]
            student = torch.log_softmax(adapter(lm, h, torch.arange(h.shape[0])).float() @ w_s.T, -1)  # [T, |S|]
            loss = torch.nn.functional.kl_div(student, c["teacher"], log_target=True, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
        losses.append(total / len(train_chunks))
        adapter.save(ckpt, metrics={"epoch": epoch, "loss": losses[-1]})
    bar.close()
    return losses


def train(cfg: DictConfig) -> dict:
    """Train, evaluate and save; returns the summary written to ``summary.json``."""
    t = cfg.train
    if t.exit_layer < 1:
        raise ConfigError(f"train.exit_layer must be >= 1, got {t.exit_layer}")
    if not 0 < t.heldout_frac < 1:
        raise ConfigError(f"train.heldout_frac must lie in (0, 1), got {t.heldout_frac}")
    out_dir = _output_dir(cfg)
    ds = cfg.dataset
    prompts = load_prompts(ds.name, None, ds.path, ds.field)[t.skip_prompts :]
    if ds.num_prompts is not None:
        prompts = prompts[: ds.num_prompts]
    if not prompts:
        raise ConfigError(f"no training texts: dataset {ds.name!r} has none after skipping {t.skip_prompts}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    m = cfg.models
    lm = load_model(m.target, m.backend, m.device)
    n_layers = decoder_parts(lm).num_layers
    if t.exit_layer >= n_layers:
        raise ConfigError(f"train.exit_layer {t.exit_layer} must be below the target's {n_layers} layers")
    t0 = time.perf_counter()
    chunks = collect_features(lm, [p.text for p in prompts], t.exit_layer, t.seq_len, t.max_tokens)
    n_held = max(1, round(len(chunks) * t.heldout_frac))
    if len(chunks) < 2:
        raise ConfigError(f"only {len(chunks)} chunk(s) of text: raise train.max_tokens or dataset.num_prompts")
    train_chunks, held = chunks[:-n_held], chunks[-n_held:]
    head_w = dense_weight(decoder_parts(lm).head)  # [V, H]
    vocab = training_vocab(train_chunks, head_w, t.vocab_topk)
    w_s = head_w[vocab]  # [|S|, H]
    for c in train_chunks:
        c["teacher"] = torch.log_softmax(c["h_final"] @ w_s.T, -1)  # [T, |S|]
    feature_s = time.perf_counter() - t0

    adapter = ExitAdapter.from_target(lm, t.exit_layer)
    adapter.train()
    alpha_exit = agreement(lm, None, held, head_w)
    alpha_init = agreement(lm, adapter, held, head_w)
    log.info("exit layer %d: held-out top-1 agreement plain exit %.3f, adapter init %.3f", t.exit_layer, alpha_exit, alpha_init)

    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / "adapter.pt"
    t1 = time.perf_counter()
    losses = _fit(adapter, lm, train_chunks, w_s, t, ckpt, cfg.progress)
    train_s = time.perf_counter() - t1
    adapter.eval()
    alpha_trained = agreement(lm, adapter, held, head_w)
    metrics = {
        "target": m.target, "exit_layer": t.exit_layer, "num_layers": n_layers,
        "train_tokens": sum(c["h_exit"].shape[0] for c in train_chunks),
        "heldout_tokens": sum(c["h_exit"].shape[0] for c in held),
        "train_vocab": int(vocab.numel()), "epochs": t.epochs, "loss_by_epoch": losses,
        "alpha_exit": alpha_exit, "alpha_adapter_init": alpha_init, "alpha_adapter_trained": alpha_trained,
        "feature_time_s": feature_s, "train_time_s": train_s,
    }
    adapter.save(ckpt, metrics=metrics)
    if t.save_to:
        adapter.save(Path(t.save_to).expanduser(), metrics=metrics)
    summary = {"config": OmegaConf.to_container(cfg, resolve=True), "metrics": metrics, "checkpoint": str(ckpt)}
    write_json_atomic(out_dir / "summary.json", summary)
    print(
        f"exit layer {t.exit_layer}/{n_layers}: held-out top-1 agreement (greedy alpha of a 1-token draft) "
        f"plain exit {alpha_exit:.3f}, adapter init {alpha_init:.3f}, trained {alpha_trained:.3f} "
        f"({metrics['train_tokens']} training tokens, {t.epochs} epochs, {train_s:.0f} s)\ncheckpoint: {ckpt}"
    )
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_adapter")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
