"""An EAGLE-style draft head: one decoder layer over the target's own features.

Feature f_t: the target's last hidden state at position t after its final norm, i.e. the input of
its LM head (``CausalLM.forward(..., return_hidden=FINAL_HIDDEN)``), from which the target reads
the distribution of token t+1. The head's input at head position t is f_t fused with the
embedding of token t+1 (``fc``: 2H -> H, EAGLE's fusion); one decoder layer of the target's own
family (its class, so RoPE, GQA and biases match; initialised from the target's last layer) with
its own KV cache, then an RMSNorm, gives a predicted feature f^_{t+1}, read out through the
target's LM head (shared; or its rows for the head's vocabulary, FR-Spec) as the distribution of
token t+2. Drafting feeds f^ back in place of the target's f for the next position.

Why the head has a final norm of its own (initialised from the target's) instead of reusing the
target's: the features live after the target's norm, so the head's output must land in that
normed space to be fed back as a feature and read by the LM head; a norm the head trains does
that. Embeddings, rotary embedding and LM head are the target's modules, never copied.

``vocab``: the token ids the head may propose (None: the whole vocabulary). Training restricts
its loss to those ids, drafting reads only their LM-head rows; every other id gets probability 0,
so q stays the exact distribution drafts are sampled from (lossless whatever the vocabulary).

Layout (:class:`HeadLayout`, saved with the weights). ``fusion="concat"``: ``fc`` reads
[f_t, e(x_{t+1})] as they are (EAGLE-1/2). ``fusion="normed"``: each half is RMS-normalised with
its own gain first (EAGLE-3's separate input norms): f_t lives after the target's final norm (RMS
~4.7 on Qwen2.5-Coder-1.5B) while embedding rows have RMS ~0.02, so unnormalised the token the
head must condition on is a fraction of a percent of ``fc``'s input. ``input_norm`` /
``output_norm``: whether the decoder layer keeps its input norm and the head its final norm
(EAGLE-1/2's released heads have neither: their layer's output goes straight to the LM head).

Checkpoints (format ``cascade.draft_head/1``) hold the target's name and sizes, the head's
vocabulary and layout, state dict and training metrics; :meth:`DraftHead.load` refuses a
checkpoint made for another target shape (hidden size, layer count, vocabulary size) or another
target name. :meth:`DraftHead.from_eagle` reads a head in the format EAGLE-1/2's released code
writes (``fc`` 2H -> H over [embedding, feature], ``layers.0.*`` without an input norm, a
``config.json``), for any target whose sizes it fits; :meth:`DraftHead.open` tells the two apart.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from cascade.models.heads.checkpoints import load_checkpoint, save_checkpoint
from cascade.models.heads.one_layer import OneLayerHead
from cascade.models.layers import decoder_parts, dense_state, trainable_attention
from cascade.models.lm import FINAL_HIDDEN, CausalLM
from cascade.models.heads.pruned_head import PrunedHead

FORMAT = "cascade.draft_head/1"
__all__ = ["EAGLE_LAYOUT", "FINAL_HIDDEN", "FORMAT", "DraftHead", "HeadCheckpointError", "HeadLayout"]


@dataclass(frozen=True)
class HeadLayout:
    """What a head's weights mean (the module docstring)."""

    fusion: str = "concat"  # "concat" | "normed"
    input_norm: bool = True  # the decoder layer's input norm
    output_norm: bool = True  # the head's final norm

    def __post_init__(self) -> None:
        if self.fusion not in ("concat", "normed"):
            raise ValueError(f"fusion must be 'concat' or 'normed', got {self.fusion!r}")


EAGLE_LAYOUT = HeadLayout("concat", input_norm=False, output_norm=False)  # EAGLE-1/2's released heads


class HeadCheckpointError(ValueError):
    """A draft-head checkpoint that does not fit the target it is loaded for."""


def head_vocab_ids(vocab, vocab_size: int) -> torch.Tensor:
    """``vocab`` as a flat int64 tensor of token ids; ValueError unless they are distinct ids in
    [0, ``vocab_size``) (and at least one)."""
    vocab = torch.as_tensor(vocab, dtype=torch.int64).reshape(-1)
    if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or vocab.unique().numel() != vocab.numel():
        raise ValueError(f"vocab must be distinct token ids in [0, {vocab_size})")
    return vocab


def target_facts(lm: CausalLM) -> dict:
    parts = decoder_parts(lm)
    return {"target": lm.name, "hidden_size": int(parts.config.hidden_size), "num_layers": parts.num_layers,
            "vocab_size": lm.vocab_size}


class DraftHead(OneLayerHead):
    def __init__(self, fc: nn.Linear, layer: nn.Module, norm: nn.Module, config, facts: dict, vocab: torch.Tensor | None,
                 layout: HeadLayout = HeadLayout(), feature_norm: nn.Module | None = None,
                 embed_norm: nn.Module | None = None) -> None:
        super().__init__()
        self.fc, self.layer, self.norm = fc, layer, norm
        self.layout = layout
        self.feature_norm = feature_norm or nn.Identity()  # "normed" fusion: RMS norms of each half
        self.embed_norm = embed_norm or nn.Identity()
        self.config = config  # a one-layer copy of the target's config (the target's is untouched)
        self.facts = dict(facts)  # the target this head was built for: name, hidden size, layers, vocabulary
        self.register_buffer("vocab", None if vocab is None else torch.as_tensor(vocab, dtype=torch.int64).reshape(-1))
        self.metrics: dict = {}

    feature_size = OneLayerHead.hidden_size  # width of the target features it reads: the last layer's, H
    hidden_layer = FINAL_HIDDEN  # which target states the decode loop hands over
    predicts_features = True  # its outputs are predicted target features (trained with EAGLE's regression)

    @classmethod
    def from_target(cls, lm: CausalLM, vocab: torch.Tensor | None = None, seed: int = 0,
                    layout: HeadLayout = HeadLayout()) -> "DraftHead":
        """A head for ``lm``: its layer initialised from the target's last decoder layer, its norm
        from the target's final norm, ``fc`` at random (seeded); ``layout`` says which norms it
        has (the "normed" fusion's two norms start at unit gain)."""
        parts = decoder_parts(lm)
        facts = target_facts(lm)
        if vocab is not None:
            vocab = head_vocab_ids(vocab, facts["vocab_size"])
        config = copy.deepcopy(parts.config)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[-1]]
        config._attn_implementation = trainable_attention(config)
        src = parts.layers[-1]
        layer = type(src)(config, layer_idx=0)
        wanted = layer.state_dict().keys()  # OneDNNLinear always carries a bias; keep only real ones
        layer.load_state_dict({k: v.float() for k, v in dense_state(src).items() if k in wanted})
        hidden = facts["hidden_size"]
        gen = torch.Generator().manual_seed(seed)
        fc = nn.Linear(2 * hidden, hidden, bias=True)
        with torch.no_grad():
            bound = 1.0 / (2 * hidden) ** 0.5
            fc.weight.copy_(torch.empty(hidden, 2 * hidden).uniform_(-bound, bound, generator=gen))
            fc.bias.zero_()
        norm = copy.deepcopy(parts.norm).float() if layout.output_norm else nn.Identity()
        if not layout.input_norm:
            layer.input_layernorm = nn.Identity()
        halves = {}
        if layout.fusion == "normed":
            for name in ("feature_norm", "embed_norm"):
                halves[name] = copy.deepcopy(parts.norm).float()
                with torch.no_grad():
                    halves[name].weight.fill_(1.0)
        return cls(fc, layer.float(), norm, config, facts, vocab, layout, **halves)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, lm: CausalLM, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [n, H] (f_t, the target's or the head's own), tokens: [n] (x_{t+1}),
        positions: [n] head positions t -> predicted features f^_{t+1} [n, H].
        With a cache, the n entries are appended to it (they must follow its content).
        ``attention_mask``: [1, 1, n, cache_len + n] 0 / -inf (tree levels, unrolled training);
        default causal. Differentiable (training) unless called under inference mode."""
        parts = decoder_parts(lm)
        dtype = self.fc.weight.dtype if isinstance(self.fc, nn.Linear) else lm.dtype
        emb = parts.embed(tokens.reshape(-1).to(lm.device)).to(dtype)  # [n, H]
        fused = torch.cat([self.feature_norm(features.to(emb.device, dtype)), self.embed_norm(emb)], -1)  # [n, 2H]
        x = self.fc(fused).unsqueeze(0)  # [1, n, H]
        pos, pe, mask = self.layer_inputs(lm, x, positions, cache, attention_mask)
        h = self.layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=cache,
                       use_cache=cache is not None)
        return self.norm(h)[0]  # [n, H]

    def readout(self, lm: CausalLM) -> nn.Module:
        """The LM head the head drafts through: the target's own (shared) for the whole
        vocabulary, else its rows for ``vocab`` on the target head's kernel (a copy of |vocab|
        rows: ``PrunedHead``; -inf at every other id)."""
        head = decoder_parts(lm).head
        return head if self.vocab is None else PrunedHead(head, self.vocab.cpu(), lm.vocab_size)

    @staticmethod
    def train_logits(features: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
        """[n, H] predicted features -> [n, |S|] logits through ``head_rows`` (the target's LM-head
        rows of the head's vocabulary; what ``readout`` computes)."""
        return features @ head_rows.T

    # ---- binding ----------------------------------------------------------------------------
    def check_target(self, lm: CausalLM) -> None:
        """Refuse a target of another shape or name."""
        facts = target_facts(lm)
        wrong = {k: (self.facts.get(k), v) for k, v in facts.items() if self.facts.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k} {mine!r} != {theirs!r}" for k, (mine, theirs) in wrong.items())
            raise HeadCheckpointError(f"draft head was built for another target ({detail}); train one for "
                                      f"{lm.name!r} with python -m cascade.train_head")

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | Path, metrics: dict | None = None) -> Path:
        payload = {
            "format": FORMAT, **self.facts, "layout": asdict(self.layout),
            "vocab": None if self.vocab is None else self.vocab.cpu(),
            "state_dict": {k: v.detach().float().cpu() for k, v in self.state_dict().items() if k != "vocab"},
            "metrics": metrics or {},
        }
        return save_checkpoint(payload, path)

    @classmethod
    def load(cls, path: str | Path, lm: CausalLM) -> "DraftHead":
        payload = load_checkpoint(path, FORMAT, "draft-head", "cascade.train_head", HeadCheckpointError)
        facts = target_facts(lm)
        wrong = {k: (payload.get(k), v) for k, v in facts.items() if payload.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: checkpoint {mine!r}, target {theirs!r}" for k, (mine, theirs) in wrong.items())
            raise HeadCheckpointError(f"{path} was trained for another target ({detail})")
        head = cls.from_target(lm, payload["vocab"], layout=HeadLayout(**payload.get("layout", {})))
        head.load_state_dict(payload["state_dict"], strict=False)
        missing = set(head.state_dict()) - set(payload["state_dict"]) - {"vocab"}
        if missing:
            raise HeadCheckpointError(f"{path} lacks weights {sorted(missing)[:5]}")
        head.metrics = payload.get("metrics", {})
        return head


    # ---- published heads ------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, lm: CausalLM) -> "DraftHead":
        """A head from ``path``: a cascade checkpoint (``python -m cascade.train_head``) or an
        EAGLE-1/2 release (a directory, or its weight file); ``cascade.models.heads.eagle3.open_head``
        also opens EAGLE-3 releases."""
        path = Path(path).expanduser()
        if path.is_dir() or path.suffix in (".bin", ".safetensors") or path.name.startswith("pytorch_model"):
            return cls.from_eagle(path, lm)
        return cls.load(path, lm)

    @classmethod
    def from_eagle(cls, path: str | Path, lm: CausalLM) -> "DraftHead":
        """An EAGLE-1/2 head in the format its released code writes: ``fc.weight`` [H, 2H] (+
        ``fc.bias``) over [embedding, feature], one decoder layer ``layers.0.*`` without an input
        norm, no final norm, the target's LM head; optionally ``embed_tokens.weight`` (a copy of the
        target's embedding: checked, not used) and a ``config.json`` beside the weights (checked
        against the target's). Refuses a checkpoint whose sizes do not fit ``lm`` and EAGLE-3's
        format (three captured layers, a draft vocabulary), naming what differs."""
        weights, config = eagle_files(Path(path).expanduser())
        return cls.from_eagle_state(weights, config, read_state(weights), lm)

    @classmethod
    def from_eagle_state(cls, weights: Path, config: dict | None, state: dict, lm: CausalLM) -> "DraftHead":
        """``from_eagle`` on a release already read (``eagle_files``, ``read_state``)."""
        if is_eagle3(state):
            raise HeadCheckpointError(
                f"{weights} is an EAGLE-3 head (midlayer.*, a draft vocabulary): load it with "
                "cascade.models.heads.eagle3.Eagle3Head.from_release or open_head (DraftHeadDrafter takes either format)")
        parts = decoder_parts(lm)
        hidden, vocab_size = int(parts.config.hidden_size), lm.vocab_size
        wrong = []
        if config is not None:
            for key, mine in (("hidden_size", hidden), ("vocab_size", vocab_size),
                              ("num_attention_heads", parts.config.num_attention_heads),
                              ("num_key_value_heads", parts.config.num_key_value_heads),
                              ("intermediate_size", parts.config.intermediate_size)):
                if key in config and int(config[key]) != int(mine):
                    wrong.append(f"{key} {config[key]} (target {mine})")
        if "fc.weight" not in state:
            raise HeadCheckpointError(f"{weights} has no fc.weight: not an EAGLE head")
        if tuple(state["fc.weight"].shape) != (hidden, 2 * hidden):
            wrong.append(f"fc.weight {tuple(state['fc.weight'].shape)} (target needs {(hidden, 2 * hidden)})")
        emb = state.get("embed_tokens.weight")
        if emb is not None and tuple(emb.shape) != (vocab_size, hidden):
            wrong.append(f"embed_tokens.weight {tuple(emb.shape)} (target {(vocab_size, hidden)})")
        deeper = sorted({k.split(".")[1] for k in state if k.startswith("layers.") and not k.startswith("layers.0.")})
        if deeper:
            wrong.append(f"decoder layers {['0'] + deeper} (cascade's head has one)")
        if wrong:
            raise HeadCheckpointError(f"{weights} was made for another target than {lm.name!r}: " + "; ".join(wrong))
        head = cls.from_target(lm, None, layout=EAGLE_LAYOUT)
        layer_state = {k[len("layers.0."):]: v.float() for k, v in state.items() if k.startswith("layers.0.")}
        expected = head.layer.state_dict()
        for key in [k for k in expected if k.endswith(".bias") and k not in layer_state]:
            layer_state[key] = torch.zeros_like(expected[key])  # a head written without q/k/v biases: zero biases
        missing, unexpected = set(expected) - set(layer_state), set(layer_state) - set(expected)
        if missing or unexpected:
            raise HeadCheckpointError(f"{weights}: layer weights do not fit {type(head.layer).__name__} (missing "
                                      f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
        bad = [k for k, v in layer_state.items() if v.shape != expected[k].shape]
        if bad:
            raise HeadCheckpointError(f"{weights}: {bad[0]} has shape {tuple(layer_state[bad[0]].shape)}, the target's "
                                      f"layer needs {tuple(expected[bad[0]].shape)}")
        head.layer.load_state_dict(layer_state)
        w = state["fc.weight"].float()
        with torch.no_grad():
            head.fc.weight.copy_(torch.cat([w[:, hidden:], w[:, :hidden]], 1))  # EAGLE reads [embedding, feature]
            head.fc.bias.copy_(state["fc.bias"].float() if "fc.bias" in state else torch.zeros(hidden))
        head.metrics = {"source": str(weights), "format": "eagle-1/2"}
        return head


def eagle_files(path: Path) -> tuple[Path, dict | None]:
    """The weight file and the parsed config.json (None when absent) of an EAGLE release."""
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        found = [folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).is_file()]
        if not found:
            raise FileNotFoundError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
        weights = found[0]
    elif path.is_file():
        weights = path
    else:
        raise FileNotFoundError(f"EAGLE head {path} does not exist")
    config = folder / "config.json"
    return weights, json.loads(config.read_text()) if config.is_file() else None


def is_eagle3(state: dict) -> bool:
    """Whether a release's state dict is EAGLE-3's (a ``midlayer``, or a draft vocabulary map)."""
    return any(k.startswith("midlayer.") for k in state) or "d2t" in state


def read_state(weights: Path) -> dict[str, torch.Tensor]:
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(weights))
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise HeadCheckpointError(f"{weights} does not hold a state dict")
    return state
