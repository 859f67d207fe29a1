"""Published EAGLE-3 heads, in the format EAGLE-3's released code writes.

An EAGLE-3 head reads three of the target's layers, not its last feature: g_t = [h^a_t, h^b_t,
h^c_t] (the residual stream after the first a, b and c decoder layers at position t; EAGLE's
default (a, b, c) = (2, L // 2, L - 3) for an L-layer target, or the release's
``eagle_aux_hidden_state_layer_ids``), fused by ``fc`` (3H -> H, no bias). Its one decoder layer
(``midlayer``) differs from a target layer in its input: attention reads
[input_layernorm(e(x_{t+1})), hidden_norm(s_t)] (2H -> q/k/v), the residual is s_t (the fused
feature, or the head's own previous output); MLP and post-attention norm as usual. Its output
s^_{t+1} is fed back as is when drafting deeper (no ``fc``: it is already H wide), and read out
through its own final ``norm`` and ``lm_head`` over a draft vocabulary of Vd ids, draft id d
being target id d + d2t[d] (``t2d`` marks the target ids that have one). Every other target id
gets probability 0, so q is the exact distribution drafts are sampled from.

:class:`Eagle3Head` keeps the interface ``DraftHeadDrafter`` drives (``forward`` -> the fed-back
state, ``readout`` -> logits over the target's vocabulary, ``new_cache`` / ``crop`` /
``cache_len``, ``for_inference``), plus ``hidden_layer`` (the tuple of target layers the decode
loop must hand over) and ``feature_size`` (3H), and what training needs (``from_target``: a fresh head; ``train_logits``:
its logits over the draft vocabulary; ``save``: a release directory, tagged ``FORMAT`` in its
config, that ``from_release`` reads back; ``python -m cascade.train_head train.recipe=eagle3``).
:func:`open_head` opens any head a ``DraftHeadDrafter`` takes: a cascade checkpoint, an EAGLE-1/2
release or an EAGLE-3 release (published, or trained here).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from cascade.models.heads.eagle import (DraftHead, HeadCheckpointError, eagle_files, head_vocab_ids, is_eagle3, read_state,
                                       target_facts)
from cascade.models.heads.one_layer import OneLayerHead
from cascade.models.layers import decoder_parts, dense_state, dense_weight, trainable_attention
from cascade.models.lm import CausalLM

__all__ = ["FORMAT", "Eagle3Head", "is_eagle3", "open_head"]

FORMAT = "cascade.eagle3_head/1"  # config.json's "cascade" entry of a head trained here


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's captured layers for an ``num_layers``-layer target: the inputs of layers 2,
    L // 2 and L - 3, i.e. the states after that many layers."""
    return 2, num_layers // 2, num_layers - 3


def rope_theta(config) -> float | None:
    """The RoPE base of a transformers config (``rope_parameters`` in transformers 5, else
    ``rope_theta``); None when it has neither."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    value = getattr(config, "rope_theta", None)
    return None if value is None else float(value)


def _attention_shape(config) -> tuple[int, int, int, int]:
    """(hidden, heads, kv heads, head dim) of a transformers config."""
    hidden, heads, kv = int(config.hidden_size), int(config.num_attention_heads), int(config.num_key_value_heads)
    return hidden, heads, kv, int(getattr(config, "head_dim", None) or hidden // heads)


def _head_config(target_config, intermediate_size: int | None = None):
    """The head's one-layer copy of the target's config (the target's is untouched)."""
    hc = copy.deepcopy(target_config)
    hc.num_hidden_layers = 1
    if getattr(hc, "layer_types", None):
        hc.layer_types = [hc.layer_types[-1]]
    if intermediate_size is not None:
        hc.intermediate_size = int(intermediate_size)
    hc._attn_implementation = trainable_attention(hc)
    return hc


def _midlayer(parts, hc, biases: set[str]) -> nn.Module:
    """The target family's decoder layer with q/k/v reading 2H ([embedding, state]); ``biases``:
    which of q_proj, k_proj, v_proj, o_proj carry one."""
    hidden, heads, kv, head_dim = _attention_shape(hc)
    layer = type(parts.layers[-1])(hc, layer_idx=0)
    attn = layer.self_attn
    for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
        setattr(attn, name, nn.Linear(2 * hidden, rows, bias=name in biases))
    attn.o_proj = nn.Linear(heads * head_dim, hidden, bias="o_proj" in biases)
    return layer


class DraftVocabReadout(nn.Module):
    """norm, then the head's own LM head over the draft vocabulary, scattered onto the target's:
    [..., H] -> [..., V] with -inf at every id outside ``vocab``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, vocab: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.register_buffer("vocab", vocab, persistent=False)
        self.out_features = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.lm_head(self.norm(hidden))  # [..., Vd]
        out = rows.new_full((*rows.shape[:-1], self.out_features), float("-inf"))
        out[..., self.vocab] = rows
        return out


class Eagle3Head(OneLayerHead):
    def __init__(self, fc: nn.Linear, layer: nn.Module, hidden_norm: nn.Module, norm: nn.Module, lm_head: nn.Linear,
                 vocab: torch.Tensor, layers: tuple[int, ...], config, facts: dict) -> None:
        super().__init__()
        self.fc, self.layer, self.hidden_norm, self.norm, self.lm_head = fc, layer, hidden_norm, norm, lm_head
        self.register_buffer("vocab", vocab)  # [Vd] target id of each draft id
        self.layers = tuple(int(i) for i in layers)
        self.config = config  # the head's own one-layer config
        self.facts = dict(facts)
        self.metrics: dict = {}

    @property
    def feature_size(self) -> int:
        """Width of the target features the loop hands over: three layers' states."""
        return len(self.layers) * self.hidden_size

    @property
    def hidden_layer(self) -> tuple[int, ...]:
        return self.layers

    predicts_features = False  # its states are its own, not target features: no feature regression

    @classmethod
    def from_target(cls, lm: CausalLM, vocab: torch.Tensor | None = None, layers: tuple[int, ...] | None = None,
                    seed: int = 0) -> "Eagle3Head":
        """A fresh head for ``lm``, to train (``python -m cascade.train_head train.recipe=eagle3``).
        ``layers``: the target layers it reads (None: EAGLE-3's default); ``vocab``: its draft
        vocabulary, target ids (sorted here; None: all). Its layer's o_proj, MLP and
        post-attention norm start as the target's last layer's, q/k/v (2H wide) and ``fc`` at
        random (seeded), the two input norms at unit gain, ``norm`` and ``lm_head`` as the
        target's final norm and its LM-head rows of ``vocab``."""
        parts = decoder_parts(lm)
        layers = tuple(int(i) for i in (layers or default_layers(parts.num_layers)))
        if not layers or not all(1 <= i < parts.num_layers for i in layers):
            raise ValueError(f"layers must be target layers in [1, {parts.num_layers - 1}], got {layers}")
        vocab = torch.arange(lm.vocab_size) if vocab is None else head_vocab_ids(vocab, lm.vocab_size).sort().values
        hc = _head_config(parts.config)
        hidden = _attention_shape(hc)[0]
        src = dense_state(parts.layers[-1])
        layer = _midlayer(parts, hc, {n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if f"self_attn.{n}.bias" in src})
        gen = torch.Generator().manual_seed(seed)
        own = layer.state_dict()
        fresh = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "input_layernorm.")
        layer.load_state_dict({k: v.float() for k, v in src.items() if k in own and not k.startswith(fresh)}, strict=False)
        fc = nn.Linear(len(layers) * hidden, hidden, bias=False)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, name)
                bound = 1.0 / (2 * hidden) ** 0.5
                lin.weight.copy_(torch.empty_like(lin.weight).uniform_(-bound, bound, generator=gen))
                if lin.bias is not None:
                    lin.bias.zero_()
            layer.input_layernorm.weight.fill_(1.0)
            bound = 1.0 / (len(layers) * hidden) ** 0.5
            fc.weight.copy_(torch.empty_like(fc.weight).uniform_(-bound, bound, generator=gen))
        hidden_norm = copy.deepcopy(parts.norm).float()
        with torch.no_grad():
            hidden_norm.weight.fill_(1.0)
        norm = copy.deepcopy(parts.norm).float()
        lm_head = nn.Linear(hidden, vocab.numel(), bias=False)
        target_rows = dense_weight(parts.head)  # [V, H] (whatever kernel the target's head runs on)
        with torch.no_grad():
            lm_head.weight.copy_(target_rows[vocab.to(target_rows.device)].float().cpu())
        return cls(fc, layer.float(), hidden_norm, norm, lm_head, vocab, layers, hc, target_facts(lm))

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, lm: CausalLM, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache=None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [n, 3H] (the target's three layers: fused by ``fc``) or [n, H] (the head's own
        previous outputs, fed as they are), tokens: [n] (x_{t+1}), positions: [n] -> the head's
        states [n, H] (before its final norm: what it feeds back)."""
        parts = decoder_parts(lm)
        dtype = self.fc.weight.dtype if isinstance(self.fc, nn.Linear) else lm.dtype
        emb = parts.embed(tokens.reshape(-1).to(lm.device)).to(dtype)  # [n, H]
        s = features.to(emb.device, dtype)
        if s.shape[-1] == self.feature_size:
            s = self.fc(s)  # [n, H]
        elif s.shape[-1] != self.hidden_size:
            raise ValueError(f"features of width {s.shape[-1]}: this head takes {self.feature_size} (the target's "
                             f"layers {self.layers}) or {self.hidden_size} (its own states)")
        s = s.unsqueeze(0)  # [1, n, H]
        pos, pe, mask = self.layer_inputs(lm, s, positions, cache, attention_mask)
        layer = self.layer
        attn_in = torch.cat([layer.input_layernorm(emb.unsqueeze(0)), self.hidden_norm(s)], -1)  # [1, n, 2H]
        attn, _ = layer.self_attn(hidden_states=attn_in, attention_mask=mask, position_ids=pos, cache=cache,
                                  use_cache=cache is not None, position_embeddings=pe)
        h = s + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h[0]  # [n, H]

    def readout(self, lm: CausalLM) -> nn.Module:
        return DraftVocabReadout(self.norm, self.lm_head, self.vocab, lm.vocab_size)

    def train_logits(self, states: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
        """[n, H] states -> [n, Vd] logits over the draft vocabulary (its own norm and LM head;
        ``head_rows``, the target's rows of that vocabulary, serve only the teacher)."""
        return self.lm_head(self.norm(states))

    # ---- checkpoints (the release format) -------------------------------------------------------
    def release_state(self) -> dict[str, torch.Tensor]:
        """The weights under the key names EAGLE-3's released code writes (no embedding copy:
        the head runs on the target's)."""
        vocab = self.vocab.cpu()
        t2d = torch.zeros(int(self.facts["vocab_size"]), dtype=torch.bool)
        t2d[vocab] = True
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
                 "midlayer.hidden_norm.weight": self.hidden_norm.weight,
                 **{f"midlayer.{k}": v for k, v in self.layer.state_dict().items()},
                 "d2t": vocab - torch.arange(vocab.numel()), "t2d": t2d}
        return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous() for k, v in state.items()}

    def release_config(self, metrics: dict | None = None) -> dict:
        """config.json as EAGLE-3's released code writes it, plus cascade's entry (``FORMAT``, the
        target, the training metrics)."""
        c = self.config
        hidden, heads, kv, _ = _attention_shape(c)
        return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
                "intermediate_size": int(c.intermediate_size), "num_attention_heads": heads, "num_key_value_heads": kv,
                "num_hidden_layers": 1, "vocab_size": int(self.facts["vocab_size"]),
                "draft_vocab_size": int(self.vocab.numel()), "rms_norm_eps": float(c.rms_norm_eps),
                "rope_theta": rope_theta(c), "max_position_embeddings": int(c.max_position_embeddings),
                "hidden_act": str(getattr(c, "hidden_act", "silu")), "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.layers)},
                "cascade": {"format": FORMAT, "target": self.facts["target"], "metrics": metrics or {}}}

    def save(self, path: str | Path, metrics: dict | None = None) -> Path:
        """Write the head as an EAGLE-3 release: the directory ``path`` with ``model.safetensors``
        and ``config.json``, each written atomically (weights first); ``open_head`` and
        ``from_release`` read it back."""
        from safetensors.torch import save_file

        folder = Path(path).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"model.safetensors.tmp{os.getpid()}"
        save_file(self.release_state(), str(tmp))
        os.replace(tmp, folder / "model.safetensors")
        tmp = folder / f"config.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(self.release_config(metrics), indent=1))
        os.replace(tmp, folder / "config.json")
        return folder

    # ---- binding ----------------------------------------------------------------------------
    def check_target(self, lm: CausalLM) -> None:
        facts = target_facts(lm)
        wrong = {k: (self.facts.get(k), v) for k, v in facts.items() if k != "target" and self.facts.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k} {mine!r} != {theirs!r}" for k, (mine, theirs) in wrong.items())
            raise HeadCheckpointError(f"EAGLE-3 head was loaded for another target ({detail})")

    # ---- releases -------------------------------------------------------------------------------
    @classmethod
    def from_release(cls, path: str | Path, lm: CausalLM) -> "Eagle3Head":
        """An EAGLE-3 head as its released code writes it (a directory with ``config.json`` and
        ``model.safetensors`` / ``pytorch_model.bin``, or the weight file): ``fc.weight`` [H, 3H],
        ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``,
        ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H], ``o_proj``, ``midlayer.mlp.*``,
        ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] (absent when Vd = V), optional
        ``t2d`` / ``embed_tokens.weight`` (checked). Refuses weights or a config that do not fit
        ``lm``, naming each difference."""
        weights, config = eagle_files(Path(path).expanduser())
        return cls.from_release_state(weights, config, read_state(weights), lm)

    @classmethod
    def from_release_state(cls, weights: Path, config: dict | None, state: dict, lm: CausalLM) -> "Eagle3Head":
        """``from_release`` on a release already read (``eagle_files``, ``read_state``)."""
        if not is_eagle3(state):
            raise HeadCheckpointError(f"{weights} is not an EAGLE-3 head (no midlayer.*): DraftHead.from_eagle reads EAGLE-1/2")
        parts = decoder_parts(lm)
        tc, config = parts.config, config or {}
        hidden = _attention_shape(tc)[0]
        layers, draft_vocab, vocab, ours = _check_release(weights, config, state, lm)

        # the head's layer: the target family's decoder layer with q/k/v reading 2H
        hc = _head_config(tc, config.get("intermediate_size"))
        layer = _midlayer(parts, hc, {n for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                                      if f"midlayer.self_attn.{n}.bias" in state})
        hidden_norm = copy.deepcopy(parts.norm)
        layer_state = {k[len("midlayer."):]: v.float() for k, v in state.items()
                       if k.startswith("midlayer.") and not k.startswith("midlayer.hidden_norm.")}
        expected = layer.float().state_dict()
        unexpected, absent = set(layer_state) - set(expected), set(expected) - set(layer_state)
        bad = [k for k in set(layer_state) & set(expected) if layer_state[k].shape != expected[k].shape]
        if unexpected or absent or bad:
            raise HeadCheckpointError(f"{weights}: midlayer weights do not fit {type(layer).__name__} (missing "
                                      f"{sorted(absent)[:4]}, unexpected {sorted(unexpected)[:4]}, wrong shapes "
                                      f"{sorted(bad)[:4]})")
        layer.load_state_dict(layer_state)
        with torch.no_grad():
            hidden_norm.weight.copy_(state["midlayer.hidden_norm.weight"].float())
        norm = copy.deepcopy(parts.norm).float()
        with torch.no_grad():
            norm.weight.copy_(state["norm.weight"].float())
        fc = nn.Linear(len(layers) * hidden, hidden, bias=False)
        lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        with torch.no_grad():
            fc.weight.copy_(state["fc.weight"].float())
            lm_head.weight.copy_(state["lm_head.weight"].float())
        head = cls(fc, layer, hidden_norm.float(), norm, lm_head, vocab, layers, hc, target_facts(lm))
        head.metrics = {"source": str(weights), "format": "eagle-3", "layers": list(layers), "draft_vocab": draft_vocab,
                        **(ours.get("metrics") or {})}
        return head


def _check_release(weights: Path, config: dict, state: dict, lm: CausalLM):
    """An EAGLE-3 release against ``lm``: (captured layers, draft vocabulary size, the target id of
    each draft id, cascade's own metadata) or ``HeadCheckpointError`` naming every difference."""
    parts = decoder_parts(lm)
    tc = parts.config
    hidden, heads, kv, head_dim = _attention_shape(tc)
    vocab_size = lm.vocab_size
    wrong = []
    for key, mine in (("hidden_size", hidden), ("vocab_size", vocab_size), ("num_attention_heads", heads),
                      ("num_key_value_heads", kv)):
        if key in config and int(config[key]) != int(mine):
            wrong.append(f"{key} {config[key]} (target {mine})")
    if "target_hidden_size" in config and int(config["target_hidden_size"]) != hidden:
        wrong.append(f"target_hidden_size {config['target_hidden_size']} (target {hidden})")
    theta = rope_theta(tc)
    if config.get("rope_theta") is not None and theta is not None and float(config["rope_theta"]) != theta:
        wrong.append(f"rope_theta {config['rope_theta']} (target {theta}: the head runs on the target's rotary)")
    missing = [k for k in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight",
                           "midlayer.self_attn.q_proj.weight") if k not in state]
    if missing:
        raise HeadCheckpointError(f"{weights} lacks {missing}: not a complete EAGLE-3 head")
    layers = tuple(int(i) for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                   or default_layers(parts.num_layers))
    if not all(1 <= i < parts.num_layers for i in layers):
        wrong.append(f"captured layers {layers} (the target has {parts.num_layers})")
    if tuple(state["fc.weight"].shape) != (hidden, len(layers) * hidden):
        wrong.append(f"fc.weight {tuple(state['fc.weight'].shape)} (target needs {(hidden, len(layers) * hidden)})")
    q_shape = tuple(state["midlayer.self_attn.q_proj.weight"].shape)
    if q_shape != (heads * head_dim, 2 * hidden):
        wrong.append(f"midlayer.self_attn.q_proj.weight {q_shape} (target needs {(heads * head_dim, 2 * hidden)})")
    draft_vocab = int(state["lm_head.weight"].shape[0])
    if "draft_vocab_size" in config and int(config["draft_vocab_size"]) != draft_vocab:
        wrong.append(f"draft_vocab_size {config['draft_vocab_size']} but lm_head.weight has {draft_vocab} rows")
    emb = state.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (vocab_size, hidden):
        wrong.append(f"embed_tokens.weight {tuple(emb.shape)} (target {(vocab_size, hidden)})")
    d2t = state.get("d2t")
    if d2t is None:
        if draft_vocab != vocab_size:
            wrong.append(f"lm_head.weight has {draft_vocab} rows but no d2t maps them onto the target's {vocab_size}")
        vocab = torch.arange(vocab_size)
    else:
        vocab = torch.arange(d2t.numel()) + d2t.long()
        if d2t.numel() != draft_vocab:
            wrong.append(f"d2t has {d2t.numel()} entries, lm_head.weight {draft_vocab} rows")
        elif int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or vocab.unique().numel() != vocab.numel():
            wrong.append(f"d2t maps draft ids outside [0, {vocab_size}) or two onto one target id")
        elif "t2d" in state and not torch.equal(state["t2d"].bool().nonzero().reshape(-1), vocab.sort().values):
            wrong.append("t2d does not mark exactly the target ids d2t maps onto")
    ours = config.get("cascade") or {}  # a head trained here names its target
    if ours.get("target") not in (None, lm.name):
        wrong.append(f"trained for {ours['target']!r}")
    if wrong:
        raise HeadCheckpointError(f"{weights} does not fit target {lm.name!r}: " + "; ".join(wrong))
    return layers, draft_vocab, vocab, ours


def open_head(path: str | Path, lm: CausalLM) -> DraftHead | Eagle3Head:
    """The head at ``path``, whichever format: a cascade checkpoint (``python -m
    cascade.train_head``), an EAGLE-1/2 release or an EAGLE-3 release (a directory, or its weight
    file)."""
    path = Path(path).expanduser()
    if path.is_dir() or path.suffix in (".bin", ".safetensors") or path.name.startswith("pytorch_model"):
        weights, config = eagle_files(path)
        state = read_state(weights)  # read once: its keys tell the format
        loader = Eagle3Head.from_release_state if is_eagle3(state) else DraftHead.from_eagle_state
        return loader(weights, config, state, lm)
    return DraftHead.load(path, lm)
