"""A draft head fitted for a few steps to a tiny target (tests need one accepted at several depths)."""

import torch

from cascade import generate
from cascade.head_training import Chunk, chunk_loss, target_features
from cascade.models.draft_head import EAGLE_LAYOUT, DraftHead, HeadLayout
from cascade.models.layers import decoder_parts

_fitted: dict = {}


def fitted_head(target, steps=60, seed=0, vocab=None, motif=6, layout=HeadLayout()):
    """A head trained with the unrolled loss on the target's own sampled continuations of random
    repetitive prompts; cached per (target, steps, seed, vocab, motif, layout)."""
    key = (id(target), steps, seed, None if vocab is None else tuple(vocab.tolist()), motif, layout)
    if key in _fitted:
        return _fitted[key]
    gen = torch.Generator().manual_seed(seed)
    head = DraftHead.from_target(target, vocab, seed=seed, layout=layout)
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


def write_eagle_release(head, target, folder, safetensors=False):
    """Write ``head`` (EAGLE-1/2 layout) as EAGLE-1/2's released code writes a head: ``fc`` over
    [embedding, feature], ``layers.0.*`` (no input norm), the embedding copy, ``config.json``
    (the base model's config with one layer); returns the folder."""
    import json
    from pathlib import Path

    if head.layout != EAGLE_LAYOUT:
        raise ValueError("only a head in EAGLE-1/2's layout has an EAGLE-1/2 release")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hidden = head.hidden_size
    w = head.fc.weight.detach().float()
    state = {"fc.weight": torch.cat([w[:, hidden:], w[:, :hidden]], 1).contiguous(), "fc.bias": head.fc.bias.detach().float(),
             "embed_tokens.weight": decoder_parts(target).embed.weight.detach().float().clone()}
    state.update({f"layers.0.{k}": v.detach().float().clone() for k, v in head.layer.state_dict().items()})
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    c = target.model.config
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "num_hidden_layers": 1, "vocab_size": target.vocab_size, "rms_norm_eps": c.rms_norm_eps,
              "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "bias": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


_releases: dict = {}


def eagle_release(target, motif=3):
    """A fitted EAGLE-1/2-layout head written as a release into a temporary folder (cached)."""
    import tempfile

    key = (id(target), motif)
    if key not in _releases:
        head = fitted_head(target, motif=motif, layout=EAGLE_LAYOUT)
        _releases[key] = write_eagle_release(head, target, tempfile.mkdtemp(prefix="eagle-release-"))
    return _releases[key]
