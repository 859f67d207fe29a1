"""A draft head fitted for a few steps to a tiny target (tests need one accepted at several depths)."""

import torch

from cascade import generate
from cascade.head_training import Chunk, chunk_loss, target_features
from cascade.models.heads.eagle import EAGLE_LAYOUT, DraftHead, HeadLayout
from cascade.models.layers import decoder_parts
from cascade.types import SamplingConfig

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
        out = generate(target, ids[:12], max_new_tokens=20, stop_on_eos=False, sampling=SamplingConfig(temperature=1.0), generator=gen).tokens
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


# ---- EAGLE-3 releases ---------------------------------------------------------------------------


def eagle3_state(head, target) -> dict:
    """An ``Eagle3Head``'s weights under the key names EAGLE-3's released code writes: ``fc``,
    ``midlayer.*`` (its decoder layer plus ``hidden_norm``), ``norm``, ``lm_head`` over the draft
    vocabulary, ``d2t`` / ``t2d``, and the target embedding's copy."""
    vocab = head.vocab.cpu()
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    state = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
             "midlayer.hidden_norm.weight": head.hidden_norm.weight,
             **{f"midlayer.{k}": v for k, v in head.layer.state_dict().items()},
             "d2t": vocab - torch.arange(vocab.numel()), "t2d": t2d,
             "embed_tokens.weight": decoder_parts(target).embed.weight}
    return {k: v.detach().cpu().clone().float() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in state.items()}


def eagle3_config(target, draft_vocab: int, layers=None) -> dict:
    from cascade.models.heads.eagle3 import rope_theta

    c = target.model.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": target.vocab_size,
              "draft_vocab_size": draft_vocab, "rms_norm_eps": c.rms_norm_eps, "rope_theta": rope_theta(c),
              "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "bias": False,
              "tie_word_embeddings": False}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    return config


def write_eagle3(state: dict, config: dict, folder, safetensors=False):
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _initial_eagle3_state(target, draft_ids: torch.Tensor, n_layers: int, seed: int) -> dict:
    """Random EAGLE-3 weights of the target's shapes: fc reads the last captured layer (identity
    block), lm_head starts as the target's rows of the draft vocabulary."""
    c = target.model.config
    hidden, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) * 0.1  # noqa: E731
    fc = torch.zeros(hidden, n_layers * hidden)
    fc[:, -hidden:] = torch.eye(hidden)
    parts = decoder_parts(target)
    state = {"fc.weight": fc, "norm.weight": parts.norm.weight.detach().float().clone(),
             "lm_head.weight": parts.head.weight.detach().float()[draft_ids].clone(),
             "midlayer.hidden_norm.weight": torch.ones(hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
             "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
             "midlayer.self_attn.q_proj.weight": rnd(heads * dim, 2 * hidden),
             "midlayer.self_attn.k_proj.weight": rnd(kv * dim, 2 * hidden),
             "midlayer.self_attn.v_proj.weight": rnd(kv * dim, 2 * hidden),
             "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * dim),
             "midlayer.mlp.gate_proj.weight": rnd(c.intermediate_size, hidden),
             "midlayer.mlp.up_proj.weight": rnd(c.intermediate_size, hidden),
             "midlayer.mlp.down_proj.weight": rnd(hidden, c.intermediate_size),
             "d2t": draft_ids - torch.arange(draft_ids.numel())}
    return state


_releases3: dict = {}


def eagle3_release(target, layers=None, drop=(5, 11), steps=80, seed=0, motif=3):
    """An EAGLE-3 head fitted for a few steps to ``target`` (depth-1 cross-entropy against the
    target's law of the token after next, on its own sampled continuations of repetitive prompts),
    written as EAGLE-3's code writes a release into a temporary folder (cached). Its draft
    vocabulary lacks the ids ``drop``; ``layers``: the captured layers written into the config
    (None: EAGLE-3's default for the target's depth)."""
    import tempfile

    from cascade.models.heads.eagle3 import Eagle3Head, default_layers

    key = (id(target), layers, drop, steps, seed, motif)
    if key in _releases3:
        return _releases3[key]
    draft_ids = torch.tensor([i for i in range(target.vocab_size) if i not in set(drop)])
    n_layers = len(layers) if layers is not None else len(default_layers(decoder_parts(target).num_layers))
    config = eagle3_config(target, draft_ids.numel(), layers)
    folder = write_eagle3(_initial_eagle3_state(target, draft_ids, n_layers, seed), config,
                          tempfile.mkdtemp(prefix="eagle3-release-"))
    head = Eagle3Head.from_release(folder, target).to(target.dtype)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(0, target.vocab_size, (motif,), generator=gen).tolist() * 5
        out = generate(target, ids[:12], max_new_tokens=20, stop_on_eos=False, sampling=SamplingConfig(temperature=1.0), generator=gen).tokens
        seq = ids[:12] + out
        with torch.no_grad():
            logits, g = target.forward(seq, target.new_cache(), return_hidden=head.hidden_layer)  # [T, V], [T, 3H]
            teacher = torch.softmax(logits[1:, head.vocab], -1).clone()  # [T-1, Vd] the law of x_{u+2} on the draft vocabulary
        g = g.clone()  # out of the forward's inference mode
        s = head(target, g[:-1], torch.tensor(seq[1:]), torch.arange(len(seq) - 1))  # [T-1, H]
        student = torch.log_softmax(head.lm_head(head.norm(s)), -1)
        loss = -(teacher * student).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    write_eagle3(eagle3_state(head, target), config, folder)
    _releases3[key] = folder
    return folder
