"""Kangaroo's exit adapter: one attention layer and two norms on top of an early exit.

``ExitAdapter.from_target(lm, exit_layer)`` builds the adapter from the target's own classes (its
attention module and RMSNorm, so RoPE, GQA and biases match the family) and initialises it
from the target's layer ``exit_layer`` (its input norm and attention) and final norm: before
training it is "half of the next layer", a better start than random. Its output goes through the
target's LM head (shared, not copied). It keeps its own one-layer KV cache.

Checkpoints are ``torch.save`` dicts (format ``cascade.exit_adapter/1``) holding the exit layer,
the target's name and sizes, the state dict and the training metrics; ``load`` refuses a
checkpoint made for another target shape or exit layer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from cascade.models.heads.checkpoints import load_checkpoint, save_checkpoint
from cascade.models.heads.one_layer import OneLayerHead
from cascade.models.layers import decoder_parts, dense_state, trainable_attention
from cascade.models.lm import CausalLM

FORMAT = "cascade.exit_adapter/1"


class ExitAdapter(OneLayerHead):
    def __init__(self, attn: nn.Module, in_norm: nn.Module, out_norm: nn.Module, config, exit_layer: int, target_name: str) -> None:
        super().__init__()
        self.attn, self.in_norm, self.out_norm = attn, in_norm, out_norm
        self.config = config
        self.exit_layer = exit_layer
        self.facts = {"target": target_name, "hidden_size": int(config.hidden_size)}

    @classmethod
    def from_target(cls, lm: CausalLM, exit_layer: int) -> "ExitAdapter":
        parts = decoder_parts(lm)
        if not 1 <= exit_layer < parts.num_layers:
            raise ValueError(f"exit_layer must lie in [1, {parts.num_layers - 1}], got {exit_layer}")
        config = copy.deepcopy(parts.config)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[exit_layer]]
        config._attn_implementation = trainable_attention(config)
        src = parts.layers[exit_layer]
        attn = type(src.self_attn)(config, layer_idx=0)
        wanted = attn.state_dict().keys()  # OneDNNLinear always carries a bias; keep only real ones
        attn.load_state_dict({k: v.float() for k, v in dense_state(src.self_attn).items() if k in wanted})
        in_norm = copy.deepcopy(src.input_layernorm).float()
        out_norm = copy.deepcopy(parts.norm).float()
        return cls(attn.float(), in_norm, out_norm, config, exit_layer, lm.name)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, lm: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, H] exit hidden states at ``positions`` [n] -> adapted, normed [n, H].
        With a cache, the n positions are appended to it (they must follow its content).
        ``attention_mask``: [1, 1, n, cache_len + n] 0 / -inf (a tree level); default causal."""
        x = hidden.unsqueeze(0).to(self.out_norm.weight.dtype)  # [1, n, H]
        _, pe, mask = self.layer_inputs(lm, x, positions, cache, attention_mask)
        a, _ = self.attn(self.in_norm(x), position_embeddings=pe, attention_mask=mask, cache=cache, use_cache=cache is not None)
        return self.out_norm(x + a)[0]  # [n, H]

    @torch.inference_mode()
    def extend(self, lm: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> None:
        """Append committed positions to the adapter's cache (no LM head)."""
        self.forward(lm, hidden, positions, cache)

    @torch.inference_mode()
    def logits(self, lm: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[n, V] next-token logits through the target's LM head."""
        out = self.forward(lm, hidden, positions, cache, attention_mask)
        return decoder_parts(lm).head(out.to(lm.dtype))

    def check_target(self, lm: CausalLM) -> None:
        if int(lm.model.config.hidden_size) != self.hidden_size:
            raise ValueError(f"adapter hidden size {self.hidden_size} != target {lm.name!r} hidden size {lm.model.config.hidden_size}")

    def for_exit(self, lm: CausalLM, exit_layer: int) -> "ExitAdapter":
        """Refuse another exit layer or target shape; move to the target's device and dtype (its
        own fp32-trained weights: not rounded onto the target's fp16-weight kernels)."""
        if exit_layer != self.exit_layer:
            raise ValueError(f"adapter was trained on exit layer {self.exit_layer}, the drafter uses {exit_layer}")
        self.check_target(lm)
        return self.to(lm.device, lm.dtype).eval()

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | Path, metrics: dict | None = None) -> Path:
        payload = {
            "format": FORMAT, "exit_layer": self.exit_layer, "target": self.facts["target"],
            "hidden_size": self.hidden_size,
            "state_dict": {k: v.detach().float().cpu() for k, v in self.state_dict().items()},
            "metrics": metrics or {},
        }
        return save_checkpoint(payload, path)

    @classmethod
    def load(cls, path: str | Path, lm: CausalLM) -> "ExitAdapter":
        payload = load_checkpoint(path, FORMAT, "exit-adapter", "cascade.train_adapter")
        adapter = cls.from_target(lm, int(payload["exit_layer"]))
        if payload["hidden_size"] != adapter.hidden_size:
            raise ValueError(f"{path} was trained for hidden size {payload['hidden_size']}, target {lm.name!r} has {adapter.hidden_size}")
        adapter.load_state_dict(payload["state_dict"])
        adapter.metrics = payload.get("metrics", {})
        return adapter
