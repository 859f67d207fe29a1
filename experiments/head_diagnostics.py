"""Draft-head diagnostics: is a head that the target rarely accepts short of data, of optimiser
steps, or defective?

    python experiments/head_diagnostics.py alignment                     # training tuples vs transformers' own model
    python experiments/head_diagnostics.py overfit --tokens 2000 --fusion normed --epochs 30
    python experiments/head_diagnostics.py overfit --tokens 2000 --fusion concat --epochs 30
    python experiments/head_diagnostics.py inputs --head PATH            # what the head reads: ablations, fc halves
    python experiments/head_diagnostics.py decoding --dataset humaneval --prompts 8   # decoding vs teacher-forced

``alignment``: for real prompts, the (feature, next token, target feature, target distribution)
tuples the training path builds (``head_training.target_features`` on the loaded backend, the
teacher from the LM-head rows) against what a stock transformers copy of the target gives
(``output_hidden_states``' last entry, after the final norm, and its logits) at the same
positions: the largest feature difference, the teacher's agreement with transformers' argmax,
and the same with the pairing shifted by one position (what an off-by-one would look like).

``overfit``: a few thousand tokens of the training corpus, trained epoch after epoch on the same
chunks until the training-set top-1 agreement at depth 1 reaches ``--until`` (or ``--epochs``
run out); prints the training-set agreement at depths 1-4 after each epoch. A pipeline that
cannot fit a tiny set has a defect; one that fits it and still generalises poorly is short of
data or steps.

``inputs``: a trained head's agreement on given chunks (``--tokens`` / ``--seed`` pick them as
``overfit`` does; ``--held`` the last few) as it is, with the embedding half of ``fc``'s input
zeroed and with the feature half zeroed, and the RMS of each half's contribution to ``fc``'s
output (does the head use the token it predicts after?).

``decoding``: where the head's acceptance in decoding and its held-out agreement part. For each
prompt, a greedy chain of one head token (``cascade.generate``, the loaded backend) gives the
decode-time depth-1 hits (draft == the target's argmax at the root); then the same prompt +
output is run teacher-forced (its features in one target forward, the head unrolled once over
the whole text, as ``agreement`` does on training chunks) and its depth-1 agreement is split by
region (prompt / output) and by head position (below / from ``--seq-len``, the training chunks'
length: positions the head never saw in training). Equal decode-time and teacher-forced rates
on the output clear the decode path; a drop past ``--seq-len`` points at position coverage.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import transformers
from torch import nn

from cascade import load_model
from cascade.head_training import Chunk, agreement, capture_features, chunk_loss, chunks_sha256, corpus_chunks, target_features
from cascade.models.heads.eagle import DraftHead, HeadLayout
from cascade.models.layers import decoder_parts, dense_weight
from cascade.models.zoo import cache_root

SOURCES = {"python_source": 0.35, "gsm8k_qa": 0.30, "humaneval_solutions": 0.15, "gpqa_rest": 0.15, "mtbench_rest": 0.05}


class _Zero(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def _chunks(lm, tokens: int, seq_len: int, seed: int, progress: bool = True) -> list[Chunk]:
    token_chunks = corpus_chunks(lm, SOURCES, seq_len, tokens, seed)
    folder = cache_root() / "head_features" / f"{lm.name.replace('/', '_')}-{chunks_sha256(token_chunks)[:16]}"
    return capture_features(lm, token_chunks, SOURCES, seq_len, folder, progress)


def _rows(lm, vocab):
    w = dense_weight(decoder_parts(lm).head)
    return (w if vocab is None else w[vocab]).float()


def alignment(args) -> None:
    from cascade.data import load_prompts

    lm = load_model(args.target)
    stock = load_model(args.target, backend="float32")
    rows = _rows(lm, None)
    print(f"{args.target}: training capture on {lm.dtype} ({type(decoder_parts(lm).head).__name__}) against stock "
          f"transformers fp32 (output_hidden_states[-1], logits)")
    for p in load_prompts("humaneval_full", args.prompts):
        ids = lm.encode(p.text)[: args.max_tokens]
        feats = target_features(lm, ids).float()  # [T, H] what the training path stores
        teacher = (feats[1:] @ rows.T).argmax(-1)  # the target's token after x_{u+1}: the distribution of x_{u+2}
        with torch.no_grad():
            out = stock.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hf_feats, hf_next = out.hidden_states[-1][0].float(), out.logits[0].argmax(-1)  # [T, H], [T]
        diff = float((feats - hf_feats).abs().max() / hf_feats.abs().max())
        same = float((teacher == hf_next[1:]).float().mean())
        shifted = float((teacher == hf_next[:-1]).float().mean())  # paired one position early
        off = float((feats[1:] - hf_feats[:-1]).abs().max() / hf_feats.abs().max())
        print(f"  {p.id}: {len(ids)} positions; features max |diff| / max |f| {diff:.2e} (shifted by one: {off:.2f}); "
              f"teacher argmax = transformers' next-token argmax at {same:.4f} of positions (shifted by one: {shifted:.4f})")


def _overfit_vocab(lm, chunks: list[Chunk], size: int) -> torch.Tensor:
    """The ids a head fitting ``chunks`` needs (every token there and every target argmax after
    them, so the training-set agreement can reach 1), topped up to ``size`` with the ids most
    frequent in the chunks: the FR-Spec restriction training uses, at a size that trains fast."""
    from cascade.models.heads.pruned_head import rank_by_frequency

    head = decoder_parts(lm).head
    needed = set()
    for c in chunks:
        needed.update(c.tokens.tolist())
        needed.update(head(c.features.to(lm.device, lm.dtype)).argmax(-1).tolist())
    for i in rank_by_frequency([c.tokens for c in chunks], lm.vocab_size).tolist():
        if len(needed) >= size:
            break
        needed.add(i)
    return torch.tensor(sorted(needed))


def overfit(args) -> None:
    lm = load_model(args.target)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    chunks = _chunks(lm, args.tokens, args.seq_len, args.seed)
    vocab = _overfit_vocab(lm, chunks, args.vocab)
    rows = _rows(lm, vocab).to(lm.device)
    torch.manual_seed(args.seed)
    head = DraftHead.from_target(lm, vocab, seed=args.seed, layout=HeadLayout(args.fusion))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_tokens = sum(c.tokens.numel() for c in chunks)
    print(f"{args.target}: overfit {len(chunks)} chunks ({n_tokens} tokens), head vocabulary {vocab.numel()} ids (every "
          f"token of the chunks and every target argmax there, then the most frequent), fusion {args.fusion}, lr {args.lr}, "
          f"unroll {args.unroll}, ce weight {args.ce_weight}, feature weight {args.feature_weight}", flush=True)
    t0, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        head.train()
        for c in chunks:
            loss, _ = chunk_loss(head, lm, c, rows, args.unroll, args.feature_weight, args.ce_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            step += 1
        head.eval()
        agree = agreement(head, lm, chunks, rows, vocab)
        elapsed = time.perf_counter() - t0
        print(f"epoch {epoch + 1} ({step} steps, {elapsed:.0f} s, {step * n_tokens / len(chunks) / elapsed:.0f} tokens/s): "
              f"training-set top-1 agreement at depths 1-4 " + " ".join(f"{a:.3f}" for a in agree), flush=True)
        if agree[0] >= args.until:
            break
    if args.save:
        head.save(args.save, metrics={"overfit_tokens": n_tokens, "epochs": epoch + 1, "agreement_train": agree})


def inputs(args) -> None:
    lm = load_model(args.target)
    head = DraftHead.open(args.head, lm)
    vocab = head.vocab
    chunks = _chunks(lm, args.tokens, args.seq_len, args.seed)[-args.held:]
    rows = _rows(lm, vocab)
    head.eval()
    print(f"{args.head}: layout {head.layout}; the last {len(chunks)} chunks of the {args.tokens}-token corpus (seed "
          f"{args.seed}: an overfit head's own training chunks with its --tokens / --seed)")
    print("  as trained:          " + " ".join(f"{a:.3f}" for a in agreement(head, lm, chunks, rows, vocab)))
    for half in ("embed_norm", "feature_norm"):
        keep = getattr(head, half)
        setattr(head, half, _Zero())
        print(f"  {half.split('_')[0]} half zeroed: " + " ".join(f"{a:.3f}" for a in agreement(head, lm, chunks, rows, vocab)))
        setattr(head, half, keep)
    hidden = head.hidden_size
    w = head.fc.weight.detach().float()
    with torch.no_grad():
        f = torch.cat([c.features[:-1] for c in chunks]).float()
        e = decoder_parts(lm).embed(torch.cat([c.tokens[1:] for c in chunks])).float()
        f, e = head.feature_norm.float()(f), head.embed_norm.float()(e)
        from_f, from_e = f @ w[:, :hidden].T, e @ w[:, hidden:].T
    rms = lambda x: float(x.pow(2).mean().sqrt())  # noqa: E731
    print(f"  fc's output RMS from the feature half {rms(from_f):.4f}, from the embedding half {rms(from_e):.4f} "
          f"(inputs' RMS: feature {rms(f):.3f}, embedding {rms(e):.4f})")


def decoding(args) -> None:
    from cascade import generate
    from cascade.data import encode, load_prompts
    from cascade.drafters import DraftHeadDrafter
    from cascade.head_training import unroll

    lm = load_model(args.target)
    head = DraftHead.open(args.head, lm)  # teacher-forced, as training evaluates it (fp32 weights)
    vocab, rows = head.vocab, _rows(lm, head.vocab)
    head.eval()
    target_head = decoder_parts(lm).head
    # (hits, count) per bucket: decode-time depth 1; teacher-forced by region and head position
    tally = {k: [0, 0] for k in ("decode", "tf_output", "tf_prompt", f"tf_pos<{args.seq_len}", f"tf_pos>={args.seq_len}")}
    print(f"{args.head} on {lm.name} ({lm.dtype}), {args.dataset}: {args.prompts} prompts, {args.max_new} new tokens each")
    drafter = DraftHeadDrafter(str(args.head), k=1, sample=False)  # its own copy, on the target's kernels
    for p in load_prompts(args.dataset, args.prompts):
        ids = encode(lm, p, args.chat)
        out = generate(lm, ids, drafter=drafter, max_new_tokens=args.max_new)
        rounds = [s for s in out.steps if s.drafted >= 1]
        d_hits = sum(s.draft_tokens[0] == s.target_argmax[0] for s in rounds)
        tally["decode"][0] += d_hits
        tally["decode"][1] += len(rounds)
        text = ids + out.tokens
        with torch.no_grad():
            feats = target_features(lm, text)  # [T, H]
            chunk = Chunk(torch.tensor(text), feats.to(torch.float32))
            pred = unroll(head, lm, chunk, 1)[0]  # [T-1, H]: row u predicts f_{u+1}
            got = (pred.float() @ rows.T).argmax(-1)
            got = vocab[got] if vocab is not None else got
            want = target_head(feats.to(lm.dtype)).argmax(-1)[1:]  # [T-1] the target's token after x_{u+1}
        hit = got == want
        u = torch.arange(hit.numel())
        predicts = u + 2  # index in text of the token row u predicts
        for name, sel in (("tf_output", predicts >= len(ids)), ("tf_prompt", predicts < len(ids)),
                          (f"tf_pos<{args.seq_len}", u < args.seq_len), (f"tf_pos>={args.seq_len}", u >= args.seq_len)):
            tally[name][0] += int(hit[sel].sum())
            tally[name][1] += int(sel.sum())
        tf_out = hit[predicts >= len(ids)].float().mean()
        print(f"  {p.id}: prompt {len(ids)} + {len(out.tokens)} tokens; decode-time depth-1 {d_hits}/{len(rounds)}; "
              f"teacher-forced on the output {float(tf_out):.3f}, on the prompt {float(hit[predicts < len(ids)].float().mean()):.3f}")
    print("totals (hits / count = rate):")
    for name, (h, n) in tally.items():
        print(f"  {name:14s} {h:5d} / {n:5d} = {h / max(n, 1):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["alignment", "overfit", "inputs", "decoding"])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=3, help="alignment: HumanEval texts (prompt + solution)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2000, help="overfit: corpus tokens; inputs: tokens to draw held-out chunks from")
    ap.add_argument("--held", type=int, default=4, help="inputs: how many of the last chunks to evaluate on")
    ap.add_argument("--vocab", type=int, default=4096, help="overfit: head vocabulary size")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--fusion", default="normed", choices=["normed", "concat"])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--until", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--ce-weight", type=float, default=1.0)
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--head", type=Path)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--dataset", default="humaneval", help="decoding: prompt set (cascade.data.load_prompts)")
    ap.add_argument("--chat", action="store_true", help="decoding: wrap prompts without their own setting in the chat template")
    ap.add_argument("--max-new", type=int, default=64, help="decoding: new tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    {"alignment": alignment, "overfit": overfit, "inputs": inputs, "decoding": decoding}[args.command](args)


if __name__ == "__main__":
    main()
