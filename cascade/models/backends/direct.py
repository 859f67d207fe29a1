"""transformers' decoder forward with its modules called directly: the forward every model not on
cascade's native kernels runs (the float64 test models, bf16 / fp16-weight / int8 real models).

``LlamaForCausalLM.forward`` and its family wrap the few operations of a decoding step in
framework work that costs more than the operations on a small model: output-capturing hooks on
every layer and attention module, config-default merging, keyword deprecation checks,
``nn.Module.__call__`` around every module, output records. :class:`DirectDecoder` runs the
same steps as the model's own forward (the embedding, transformers' mask builder, the rotary
embedding, the decoder layers, the final norm, the LM head on the kept positions) without that
work. A layer laid out as Llama's (Qwen2, Mistral, SmolLM2 too) runs written out
(:class:`LlamaLayer`: transformers' operations in their order, a plain linear as one
``F.linear`` on its weights); any other through its own forward (:class:`ModuleLayer`). The same
arithmetic in the same order, so bitwise the same logits and hidden states. A model whose
forward does something else (an embedding scale in the model's forward, q/k norms, a logit
soft-cap after the head) would differ: :func:`checked_direct_decoder` runs both on a probe (a
prefill, a one-token step, a tree-masked step, hidden states) and keeps transformers' forward,
logging why, unless every output is bitwise equal.

Module forward hooks do not fire inside a written-out layer: ``CausalLM.module_calls()`` runs
every module as a module (bitwise the same forward) where hooks must see them. ``run`` also
serves layer-level access (``cascade.models.layers.run_layers``: the first n
layers on the model's own cache, for early exits).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

log = logging.getLogger(__name__)

# ``return_hidden=FINAL_HIDDEN``: the last layer's hidden states after the final norm, i.e. the LM
# head's input (the features an EAGLE-style draft head reads; ``cascade.models.lm`` re-exports it).
FINAL_HIDDEN = -1


def layer_masks(config, hidden: torch.Tensor, attention_mask, cache, position_ids, sliding: bool) -> dict:
    """The masks transformers' forward builds, by layer type: [1, 1, n, past + n] (or None where
    the attention applies causality itself). ``hidden`` [1, n, H]; ``attention_mask`` None or the
    caller's 4D additive mask (trees); ``sliding``: the model has sliding-window layers."""
    kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask, "cache": cache,
              "position_ids": position_ids}
    masks = {"full_attention": create_causal_mask(**kwargs)}
    if sliding:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def direct_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` has no decoder this module can run (None when it has)."""
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not built like Llama (model.embed_tokens, layers, norm, rotary_emb)"
    if model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no LM head"
    return None


class ModuleLayer:
    """One decoder layer called as the module it is, with the arguments the model's forward
    passes (any architecture whose layers take them; its modules' hooks fire)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, hidden: torch.Tensor, embeddings, positions: torch.Tensor, cache, mask, attention) -> torch.Tensor:
        return self.layer(hidden, attention_mask=mask, position_embeddings=embeddings, position_ids=positions,
                          cache=cache, use_cache=True)


LLAMA_LAYER = ({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
               {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj", "act_fn"})


def llama_layer_unsupported(layer: nn.Module) -> str | None:
    """Why :class:`LlamaLayer` cannot run ``layer`` (None when it can): it must hold exactly a
    Llama decoder layer's modules (no q/k norms, no extra norms, full attention)."""
    names = ({n for n, _ in layer.named_children()}, {n for n, _ in getattr(layer, "self_attn", nn.Module()).named_children()},
             {n for n, _ in getattr(layer, "mlp", nn.Module()).named_children()})
    if names != LLAMA_LAYER:
        return f"{type(layer).__name__} is not laid out as a Llama decoder layer ({names})"
    attn = layer.self_attn
    if getattr(attn, "sliding_window", None) is not None or not all(hasattr(attn, a) for a in ("head_dim", "scaling", "layer_idx")):
        return "sliding-window attention or attention without head_dim / scaling / layer_idx"
    return None


def _linear(module: nn.Module):
    """``module``'s forward as a function of its input: ``F.linear`` on its own weight and bias for
    a plain ``nn.Linear`` (the same call its forward makes), the module's forward otherwise (a
    swapped or quantized linear)."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    return module.forward


class LlamaLayer:
    """A Llama / Qwen2 / Mistral decoder layer written out: the operations of transformers'
    ``LlamaDecoderLayer``, ``LlamaAttention``, ``apply_rotary_pos_emb`` and ``LlamaMLP`` in their
    order (the norms through their own forward; transformers' attention function for the model's
    attention implementation), without a module call per linear. Bitwise the layer's forward."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.q, self.k, self.v, self.o = (_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.gate, self.up, self.down = (_linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.act = mlp.act_fn
        self.in_norm, self.post_norm = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.head_dim, self.scaling, self.index = int(attn.head_dim), attn.scaling, int(attn.layer_idx)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)  # x * cos + rotate_half(x) * sin

    def __call__(self, hidden: torch.Tensor, embeddings, positions: torch.Tensor, cache, mask, attention) -> torch.Tensor:
        n = hidden.shape[1]  # hidden [1, n, E]; attention: transformers' function for the model's implementation
        cos, sin = embeddings[0][:, None], embeddings[1][:, None]  # [1, 1, n, D]
        x = self.in_norm(hidden)
        shape = (1, n, -1, self.head_dim)
        q = self._rope(self.q(x).view(shape).transpose(1, 2), cos, sin)  # [1, H, n, D]
        k = self._rope(self.k(x).view(shape).transpose(1, 2), cos, sin)  # [1, Hkv, n, D]
        v = self.v(x).view(shape).transpose(1, 2)
        keys, values = cache.update(k, v, self.index)  # [1, Hkv, L, D]
        out, _ = attention(self.attn, q, keys, values, mask, dropout=self.attn.attention_dropout if self.attn.training else 0.0,
                           scaling=self.scaling, position_ids=positions, use_cache=True)
        hidden = hidden + self.o(out.reshape(1, n, -1).contiguous())
        x = self.post_norm(hidden)
        return hidden + self.down(self.act(self.gate(x)) * self.up(x))


class DirectDecoder:
    """The decoder of one model, its modules called directly (see the module docstring): each
    layer as a :class:`LlamaLayer` where ``explicit`` and the layer is laid out as Llama's, else
    as a module (:class:`ModuleLayer`; with ``explicit=False`` every module's forward hooks fire,
    as profilers and diagnostics need: ``CausalLM.module_calls``). Holds the model's modules and
    their weight tensors (in-place changes are seen; modules swapped after it is built are not:
    build another)."""

    def __init__(self, model: nn.Module, explicit: bool = True) -> None:
        reason = direct_unsupported(model)
        if reason is not None:
            raise ValueError(f"no direct decoder: {reason}")
        base = model.model
        self.config = model.config
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.head = model.get_output_embeddings()
        n = int(self.config.num_hidden_layers)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * n)
        self.sliding = "sliding_attention" in self.layer_types
        self.steps = [LlamaLayer(layer) if explicit and llama_layer_unsupported(layer) is None else ModuleLayer(layer)
                      for layer in base.layers[:n]]

    def run(self, ids: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            n_layers: int, keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The first ``n_layers`` decoder layers on ``ids`` [n] at ``position_ids`` [n] over
        ``cache`` (their cache layers grow by n): the hidden states after them [n, H], and those
        after each layer in ``keep`` (layer count -> [n, H])."""
        hidden = self.embed(ids[None])  # [1, n, H]
        positions = position_ids[None]  # [1, n]
        masks = layer_masks(self.config, hidden, attention_mask, cache, positions, self.sliding)
        embeddings = self.rotary(hidden, position_ids=positions)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        kept: dict[int, torch.Tensor] = {}
        for i, step in enumerate(self.steps[:n_layers]):
            hidden = step(hidden, embeddings, positions, cache, masks[self.layer_types[i]], attention)  # [1, n, H]
            if i + 1 in keep:
                kept[i + 1] = hidden[0]
        return hidden[0], kept

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                keep_last: int | None, return_hidden: int | tuple[int, ...] | None):
        """``CausalLM.forward``'s contract: logits [n or keep_last, V] and, with ``return_hidden``,
        the requested hidden states [n, len * H] (layer counts, FINAL_HIDDEN = after the final norm)."""
        wanted = return_hidden if isinstance(return_hidden, tuple) else (return_hidden,)
        hidden, kept = self.run(ids, cache, position_ids, attention_mask, len(self.steps), wanted)
        hidden = self.norm(hidden)  # [n, H]
        kept[FINAL_HIDDEN] = hidden
        return forward_outputs(self.head(hidden if not keep_last else hidden[-keep_last:]), kept, return_hidden)


def forward_outputs(logits: torch.Tensor, kept: dict[int, torch.Tensor], return_hidden: int | tuple[int, ...] | None):
    """What ``CausalLM.forward`` returns (shared by the direct and the lean decoders): ``logits``
    alone, or with the hidden states ``return_hidden`` asks for, from ``kept`` (layer count or
    FINAL_HIDDEN -> [n, H]): one layer's [n, H], or several concatenated in the order given."""
    if return_hidden is None:
        return logits
    wanted = return_hidden if isinstance(return_hidden, tuple) else (return_hidden,)
    return logits, (kept[wanted[0]] if len(wanted) == 1 else torch.cat([kept[i] for i in wanted], -1))


def _probe(forward, lm) -> list[torch.Tensor]:
    """Outputs of ``forward`` (CausalLM.forward's signature) on a prefill of 3 tokens, a one-token
    step, and a two-node tree step (both nodes children of the last token), with hidden states."""
    vocab, layers = lm.vocab_size, int(lm.model.config.num_hidden_layers)
    hidden = (1, FINAL_HIDDEN) if layers >= 2 else FINAL_HIDDEN
    device = lm.device
    cache = lm.new_cache()
    outs = list(forward([1 % vocab, 2 % vocab, 3 % vocab], cache, None, None, None, hidden))
    outs.append(forward([4 % vocab], cache, None, None, 1, None))
    past = lm.cache_len(cache)
    mask = torch.zeros(1, 1, 2, past + 2, dtype=lm.dtype, device=device)  # [1, 1, 2, past + 2]
    mask[0, 0, 0, past + 1] = mask[0, 0, 1, past] = float("-inf")  # siblings do not see each other
    positions = torch.tensor([past, past], device=device)
    outs.extend(forward([0, 2 % vocab], cache, positions, mask, None, hidden))
    return outs


def checked_direct_decoder(lm) -> DirectDecoder | None:
    """A :class:`DirectDecoder` for ``lm`` (a ``CausalLM``) if it reproduces transformers' forward
    bit for bit on the probe; else None, with the reason logged (the caller keeps transformers'
    forward)."""
    reason = direct_unsupported(lm.model)
    if reason is not None:
        log.info("%s: transformers' forward (no direct decoder: %s)", lm.name, reason)
        return None
    reference = _probe(lm.transformers_forward, lm)
    reasons = []
    try:
        for explicit in (True, False):  # written-out Llama layers, else each layer as a module
            decoder = DirectDecoder(lm.model, explicit=explicit)
            lm.use_forward(decoder)  # the candidate, through lm.forward
            try:
                mine = _probe(lm.forward, lm)
            except (TypeError, ValueError, RuntimeError, AttributeError) as error:  # layers that take other arguments
                reasons.append(f"the probe failed: {type(error).__name__}: {error}")
                continue
            if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(mine, reference)):
                if reasons:
                    log.info("%s: direct decoder through each layer as a module (written-out layers: %s)", lm.name,
                             reasons[0])
                return decoder
            reasons.append("its outputs differ from transformers' forward on the probe")
    finally:
        lm.use_forward(None)  # the caller attaches what this returns
    log.info("%s: transformers' forward (no direct decoder: %s)", lm.name, "; ".join(reasons))
    return None
