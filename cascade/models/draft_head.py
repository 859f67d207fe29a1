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

Checkpoints (format ``cascade.draft_head/1``) hold the target's name and sizes, the head's
vocabulary, state dict and training metrics; :meth:`DraftHead.load` refuses a checkpoint made for
another target shape (hidden size, layer count, vocabulary size) or another target name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from cascade.models.cpu_kernels import FP16WeightLinear, fbgemm_available, use_fp16_weight_linears
from cascade.models.native import NativeFP16Linear, swap_linears
from cascade.models.checkpoints import load_checkpoint, save_checkpoint
from cascade.models.layers import decoder_parts, dense_state, trainable_attention
from cascade.models.lm import FINAL_HIDDEN, CausalLM
from cascade.models.pruned_head import PrunedHead

FORMAT = "cascade.draft_head/1"
__all__ = ["FINAL_HIDDEN", "FORMAT", "DraftHead", "HeadCheckpointError"]


class HeadCheckpointError(ValueError):
    """A draft-head checkpoint that does not fit the target it is loaded for."""


def _target_facts(lm: CausalLM) -> dict:
    parts = decoder_parts(lm)
    return {"target": lm.name, "hidden_size": int(parts.config.hidden_size), "num_layers": parts.num_layers,
            "vocab_size": lm.vocab_size}


class DraftHead(nn.Module):
    def __init__(self, fc: nn.Linear, layer: nn.Module, norm: nn.Module, config, facts: dict, vocab: torch.Tensor | None) -> None:
        super().__init__()
        self.fc, self.layer, self.norm = fc, layer, norm
        self.config = config  # a one-layer copy of the target's config (the target's is untouched)
        self.facts = dict(facts)  # the target this head was built for: name, hidden size, layers, vocabulary
        self.register_buffer("vocab", None if vocab is None else torch.as_tensor(vocab, dtype=torch.int64).reshape(-1))
        self.metrics: dict = {}

    @property
    def hidden_size(self) -> int:
        return int(self.facts["hidden_size"])

    @classmethod
    def from_target(cls, lm: CausalLM, vocab: torch.Tensor | None = None, seed: int = 0) -> "DraftHead":
        """A head for ``lm``: its layer initialised from the target's last decoder layer, its norm
        from the target's final norm, ``fc`` at random (seeded)."""
        parts = decoder_parts(lm)
        facts = _target_facts(lm)
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.int64).reshape(-1)
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= facts["vocab_size"] \
                    or vocab.unique().numel() != vocab.numel():
                raise ValueError(f"vocab must be distinct token ids in [0, {facts['vocab_size']})")
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
        norm = copy.deepcopy(parts.norm).float()
        return cls(fc, layer.float(), norm, config, facts, vocab)

    # ---- cache ------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    cache_len = staticmethod(CausalLM.cache_len)
    crop = staticmethod(CausalLM.crop)

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
        x = self.fc(torch.cat([features.to(emb.device, dtype), emb], -1)).unsqueeze(0)  # [1, n, H]
        pos = positions.reshape(1, -1).to(x.device)  # [1, n]
        pe = parts.rotary(x, position_ids=pos)
        if attention_mask is not None:
            attention_mask = attention_mask.to(x.device, x.dtype)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=pos)
        h = self.layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=cache,
                       use_cache=cache is not None)
        return self.norm(h)[0]  # [n, H]

    def readout(self, lm: CausalLM) -> nn.Module:
        """The LM head the head drafts through: the target's own (shared) for the whole
        vocabulary, else its rows for ``vocab`` on the target head's kernel (a copy of |vocab|
        rows: ``PrunedHead``; -inf at every other id)."""
        head = decoder_parts(lm).head
        return head if self.vocab is None else PrunedHead(head, self.vocab.cpu(), lm.vocab_size)

    # ---- binding ----------------------------------------------------------------------------
    def check_target(self, lm: CausalLM) -> None:
        """Refuse a target of another shape or name."""
        facts = _target_facts(lm)
        wrong = {k: (self.facts.get(k), v) for k, v in facts.items() if self.facts.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k} {mine!r} != {theirs!r}" for k, (mine, theirs) in wrong.items())
            raise HeadCheckpointError(f"draft head was built for another target ({detail}); train one for "
                                      f"{lm.name!r} with python -m cascade.train_head")

    def for_inference(self, lm: CausalLM) -> "DraftHead":
        """Move to the target's device and dtype, in eval mode; on a target whose LM head runs on
        fp16 weights (FBGEMM's or cascade's native kernel), run the head's linears on that kernel too (weights rounded to fp16
        first: the head is then that rounded head, whose distributions are the q it reports)."""
        self.check_target(lm)
        self.to(lm.device, lm.dtype).eval()
        target_head = decoder_parts(lm).head
        fbgemm = isinstance(target_head, FP16WeightLinear) and fbgemm_available()
        if fbgemm or isinstance(target_head, NativeFP16Linear):
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(p.half().float())
            if fbgemm:
                use_fp16_weight_linears(self)
            else:
                swap_linears(self, NativeFP16Linear)
        return self

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | Path, metrics: dict | None = None) -> Path:
        payload = {
            "format": FORMAT, **self.facts,
            "vocab": None if self.vocab is None else self.vocab.cpu(),
            "state_dict": {k: v.detach().float().cpu() for k, v in self.state_dict().items() if k != "vocab"},
            "metrics": metrics or {},
        }
        return save_checkpoint(payload, path)

    @classmethod
    def load(cls, path: str | Path, lm: CausalLM) -> "DraftHead":
        payload = load_checkpoint(path, FORMAT, "draft-head", "cascade.train_head", HeadCheckpointError)
        facts = _target_facts(lm)
        wrong = {k: (payload.get(k), v) for k, v in facts.items() if payload.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: checkpoint {mine!r}, target {theirs!r}" for k, (mine, theirs) in wrong.items())
            raise HeadCheckpointError(f"{path} was trained for another target ({detail})")
        head = cls.from_target(lm, payload["vocab"])
        head.load_state_dict(payload["state_dict"], strict=False)
        missing = set(head.state_dict()) - set(payload["state_dict"]) - {"vocab"}
        if missing:
            raise HeadCheckpointError(f"{path} lacks weights {sorted(missing)[:5]}")
        head.metrics = payload.get("metrics", {})
        return head

