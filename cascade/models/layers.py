"""Layer-level access to a decoder-only model: run its first ``n`` layers on its own KV cache.

Decoders built like Llama / Qwen2 / Mistral (embeddings, a ``layers`` list, a final ``norm``, a
``rotary_emb``, the LM head): the first ``n`` layers run through
``cascade.models.backends.direct.DirectDecoder.run``, which mirrors the model's own forward layer for
layer (same mask builder, same position embeddings, the same layer arithmetic). Nothing here mutates the
model or its config: self-drafting shares the target's weights and cache as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cascade.models.backends.direct import DirectDecoder
from cascade.models.lm import CausalLM


@dataclass(frozen=True)
class DecoderParts:
    embed: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    rotary: torch.nn.Module
    head: torch.nn.Module
    config: object

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)


def dense_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` as a dense module would hold them: any swapped linear child
    (oneDNN, FBGEMM fp16 weights) read back through its ``dense_state``."""
    if hasattr(module, "dense_state"):
        return module.dense_state()
    state = {k: v.detach() for k, v in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        sub = child.dense_state() if hasattr(child, "dense_state") else dense_state(child)
        state.update({f"{name}.{k}": v for k, v in sub.items()})
    return state


def dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """[out, in] fp32 weight of an nn.Linear or a swapped linear (oneDNN, fp16 weights)."""
    return dense_state(linear)["weight"].float()


def trainable_attention(config) -> str:
    """The attention implementation a trained module copied from the target (a draft head, an
    exit adapter) runs: the target's, unless it is cascade's native kernel, which has no backward
    (gradients would silently not flow through it): then transformers' sdpa."""
    from cascade.models.backends.native import ATTENTION

    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    return "sdpa" if impl == ATTENTION else impl


def decoder_parts(lm: CausalLM) -> DecoderParts:
    base = lm.model.get_decoder()
    missing = [a for a in ("layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if missing:
        raise TypeError(
            f"model {lm.name!r} ({type(base).__name__}) lacks {missing}: layer access supports decoders "
            "built like Llama / Qwen2 / Mistral (embed_tokens, layers, norm, rotary_emb)"
        )
    return DecoderParts(lm.model.get_input_embeddings(), base.layers, base.norm, base.rotary_emb,
                        lm.model.get_output_embeddings(), lm.model.config)


@torch.inference_mode()
def run_layers(
    lm: CausalLM,
    tokens: torch.Tensor | list[int],  # [n]
    cache: DynamicCache,
    n_layers: int,
    position_ids: torch.Tensor | None = None,  # [n]; default: continue after layer 0's cache
    attention_mask: torch.Tensor | None = None,  # [1, 1, n, past + n] float, 0 / -inf (trees)
) -> torch.Tensor:
    """Hidden states [n, H] after the first ``n_layers`` decoder layers (before the final norm).
    Appends the n positions to the cache of those layers only."""
    parts = decoder_parts(lm)
    if not 1 <= n_layers <= parts.num_layers:
        raise ValueError(f"n_layers must lie in [1, {parts.num_layers}], got {n_layers}")
    ids = torch.as_tensor(tokens, dtype=torch.long, device=lm.device).reshape(-1)  # [n]
    if position_ids is None:
        start = int(cache.layers[0].get_seq_length()) if len(cache.layers) else 0
        position_ids = torch.arange(start, start + ids.shape[0], device=lm.device)
    # the model's own direct forward where it runs one (checked bitwise at its first forward),
    # else its layers called as modules, as transformers' forward calls them
    decoder = lm.lean if isinstance(lm.lean, DirectDecoder) else DirectDecoder(lm.model, explicit=False)
    hidden, _ = decoder.run(ids, cache, position_ids.reshape(-1).to(lm.device), attention_mask, n_layers)
    return hidden  # [n, H]


@torch.inference_mode()
def head_logits(lm: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head on hidden states [n, H] -> logits [n, V]."""
    parts = decoder_parts(lm)
    return parts.head(parts.norm(hidden))


def layer_lengths(cache: DynamicCache) -> list[int]:
    return [int(layer.get_seq_length()) for layer in cache.layers]


def crop_layers(cache: DynamicCache, n_layers: int, length: int) -> None:
    """Crop the first ``n_layers`` layers of ``cache`` to ``length`` positions."""
    for layer in cache.layers[:n_layers]:
        drop = int(layer.get_seq_length()) - length
        if drop > 0:
            layer.crop(-drop)
