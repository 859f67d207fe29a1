"""A draft head fitted for a few steps to a tiny target (tests need one accepted at several depths)."""

import torch

from cascade import generate
from cascade.head_training import Chunk, chunk_loss, target_features
from cascade.models.draft_head import DraftHead
from cascade.models.layers import decoder_parts

_fitted: dict = {}


def fitted_head(target, steps=60, seed=0, vocab=None, motif=6):
    """A head trained with the unrolled loss on the target's own sampled continuations of random
    repetitive prompts; cached per (target, steps, seed, vocab)."""
    key = (id(target), steps, seed, None if vocab is None else tuple(vocab.tolist()))
    if key in _fitted:
        return _fitted[key]
    gen = torch.Generator().manual_seed(seed)
    head = DraftHead.from_target(target, vocab, seed=seed)
    rows = decoder_parts(target).head.weight.detach().float()
    rows = rows if vocab is None else rows[vocab]
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(0, target.vocab_size, (motif,), generator=gen).tolist() * 5
        out = generate(target, ids[:12], max_new_tokens=20, stop_on_eos=False, temperature=1.0, generator=gen).tokens
        seq = ids[:12] + out
        loss, _ = chunk_loss(head, target, Chunk(torch.tensor(seq), target_features(target, seq)), rows, 2, 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _fitted[key] = head.eval()
    return _fitted[key]
