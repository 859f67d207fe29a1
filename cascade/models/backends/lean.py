"""A lean forward for the few tokens decoding, drafting and verification run, for decoders built
like Llama / Qwen2 (embed_tokens, layers of self_attn {q,k,v,o}_proj + mlp {gate,up,down}_proj
with RMSNorms, norm, rotary_emb, lm_head) whose linear layers run cascade's native kernels.

What it removes is the framework's per-op work around the kernels, which dominates a small
model's token on these CPUs (the int8 0.5B drafter: ~5 ms of ~20 per token): no mask building,
no per-layer keyword plumbing or output records, no ``generate``-oriented checks; per layer the
model's own linears, the native attention, and one native call each for the two RMSNorms, the
rotary embedding of q and of k and the gated activation (the RMSNorm a loop in ATen's own order
of operations, the others the same ATen operations in the same order as transformers', so
bitwise the same: checked once per model for the norms, which fall back to the model's modules
otherwise), and where both norms are fused the whole layer as one native call that writes this
call's keys and values into the cache's reserved positions (:class:`FusedLayer`). The logits are
bitwise those of the transformers forward with the same kernels (tested).

It keeps what the loop relies on: explicit positions, a 4D additive attention mask (trees),
hidden states after a layer or after the final norm (heads, adapters), and the cache: the
model's own ``DynamicCache`` (its :class:`PreallocatedLayer` buffers written in place, any other
layer through its ``update``), so crop and compaction are unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from cascade.models.backends import native
from cascade.models.backends.direct import FINAL_HIDDEN, forward_outputs
from cascade.models.kv_cache import PreallocatedLayer
from cascade.models.backends.native import NativeLinear, use_native_attention

log = logging.getLogger(__name__)

SUPPORTED_ACT = ("silu",)


def lean_unsupported(model: nn.Module) -> str | None:
    """Why the lean forward cannot run ``model`` (None when it can)."""
    config = model.config
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not a Llama / Qwen2-style decoder"
    if getattr(config, "hidden_act", None) not in SUPPORTED_ACT:
        return f"activation {getattr(config, 'hidden_act', None)!r} (supported: {SUPPORTED_ACT})"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(m, NativeLinear) for m in names):
            return "a decoder linear layer is not on cascade's native kernels"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
    return None


@dataclass(frozen=True, eq=False)
class FusedNorm:
    """transformers' RMSNorm as one native call (``weight * (x * rsqrt(mean(x^2) + eps))``): a
    loop in ATen's own order of operations where :func:`native.norm_lanes` found that order here,
    else ATen's operations from C++."""

    weight: torch.Tensor
    eps: float
    op: object  # the extension's NormOp

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> "FusedNorm":
        return cls(weight, eps, native.native_kernels().NormOp(weight, eps, native.norm_lanes()))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.op(h)


def _fused_norm(module: nn.Module) -> FusedNorm | nn.Module:
    """The native one-call RMSNorm for ``module`` if it computes bitwise what the module does
    (checked on a random input), else the module itself."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or weight is None:
        return module
    fused = FusedNorm.of(weight, float(eps))
    x = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        if not torch.equal(fused(x), module(x)):
            return module
    return fused


class OpsLayer:
    """One decoder layer, operation by operation from Python: the model's linears, the native
    attention, the norms (fused where bitwise, else the modules), RoPE and the activation."""

    def __init__(self, layer: nn.Module, in_norm, post_norm, head_dim: int, scaling: float) -> None:
        self.layer, self.in_norm, self.post_norm = layer, in_norm, post_norm
        self.head_dim, self.scaling = head_dim, scaling
        self.kernels = native.native_kernels()

    def __call__(self, h: torch.Tensor, index: int, cos: torch.Tensor, sin: torch.Tensor, cache,
                 mask: torch.Tensor | None) -> torch.Tensor:  # h [n, E] -> [n, E]
        attn, n, d = self.layer.self_attn, h.shape[0], self.head_dim
        x = self.in_norm(h)
        q = attn.q_proj(x).view(1, n, -1, d).transpose(1, 2)  # [1, H, n, D]
        k = attn.k_proj(x).view(1, n, -1, d).transpose(1, 2)  # [1, Hkv, n, D]
        v = attn.v_proj(x).view(1, n, -1, d).transpose(1, 2)
        q = self.kernels.rope(q, cos, sin)  # (q * cos) + (rotate_half(q) * sin), as transformers'
        k = self.kernels.rope(k, cos, sin)
        keys, values = cache.update(k, v, index)  # [1, Hkv, L, D] (the cache's own layer)
        out = native.attention_kernel(q, keys, values, mask, self.scaling)  # [1, n, H, D]
        h = h + attn.o_proj(out.reshape(n, -1))
        mlp = self.layer.mlp
        x = self.post_norm(h)
        return h + mlp.down_proj(self.kernels.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _side_by_side(linears: list) -> list:
    """Layers reading the same input as the extension's ops: one joined op where
    :func:`native.side_by_side` can join them, else one op per layer (the call concatenates)."""
    joined = native.side_by_side(linears)
    return [joined] if joined is not None else [m.op() for m in linears]


class FusedLayer:
    """The same layer as one native call (``layer_step``: norm, projections, RoPE, this call's
    keys and values written into the cache's reserved positions, attention, o_proj, residual,
    norm, MLP, residual) on a cache of :class:`PreallocatedLayer`; around any other cache layer's
    ``update``, two calls (``layer_qkv``, ``layer_rest``). The same operations in the same order,
    so bitwise :class:`OpsLayer`, without the interpreter's work between them. q / k / v and
    gate / up run as one joined op each where :func:`native.side_by_side` can join them (their
    weights then live in one buffer per layer, the modules holding views). Needs both norms
    fused."""

    def __init__(self, layer: nn.Module, in_norm: FusedNorm, post_norm: FusedNorm, head_dim: int, scaling: float) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _side_by_side([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = _side_by_side([mlp.gate_proj, mlp.up_proj])
        self.kernels = native.native_kernels()
        self.ops = self.kernels.LayerOps(
            in_norm=in_norm.op, qkv=self.qkv, nq=attn.q_proj.out_features, nk=attn.k_proj.out_features,
            head_dim=head_dim, o_proj=attn.o_proj.op(), post_norm=post_norm.op, gate_up=self.gate_up,
            down_proj=mlp.down_proj.op(), scaling=scaling)
        kv_heads = attn.k_proj.out_features // head_dim
        self.kv_like = torch.empty(1, kv_heads, 0, head_dim)  # the cache buffers' shape [1, Hkv, *, D] and dtype

    def __call__(self, h: torch.Tensor, index: int, cos: torch.Tensor, sin: torch.Tensor, cache,
                 mask: torch.Tensor | None) -> torch.Tensor:  # h [n, E] -> [n, E]
        layer_cache = cache.layers[index] if index < len(cache.layers) else None
        if isinstance(layer_cache, PreallocatedLayer):
            k_buf, v_buf, start = layer_cache.reserve(self.kv_like, h.shape[0])  # [1, Hkv, capacity, D]
            return self.kernels.layer_step(h, self.ops, k_buf, v_buf, start, cos, sin, mask)
        q, k, v = self.kernels.layer_qkv(h, self.ops, cos, sin)
        keys, values = cache.update(k, v, index)  # [1, Hkv, L, D]
        return self.kernels.layer_rest(h, q, keys, values, mask, self.ops)


class LeanDecoder:
    """The lean forward of one model (built once per ``CausalLM`` by :func:`load_model`).
    ``fused_layers``: run each layer whose norms are fused as :class:`FusedLayer` (default), else
    every layer as :class:`OpsLayer` (bitwise the same; what the fused calls save is measured by
    ``experiments/forward_cost.py``'s ``native_ops`` backend)."""

    def __init__(self, model: nn.Module, fused_layers: bool = True) -> None:
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"lean forward unsupported: {reason}")
        base = model.model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.head = model.get_output_embeddings()
        attn = base.layers[0].self_attn
        head_dim, scaling = int(attn.head_dim), float(attn.scaling)
        self.layers = []
        for layer in base.layers:
            in_norm, post_norm = _fused_norm(layer.input_layernorm), _fused_norm(layer.post_attention_layernorm)
            fused = fused_layers and isinstance(in_norm, FusedNorm) and isinstance(post_norm, FusedNorm)
            self.layers.append((FusedLayer if fused else OpsLayer)(layer, in_norm, post_norm, head_dim, scaling))
        self.final_norm = _fused_norm(self.norm)
        # every layer fused: on a cache of PreallocatedLayer the whole decoder is one native call
        all_fused = bool(self.layers) and all(isinstance(layer, FusedLayer) for layer in self.layers)
        self.kernels = native.native_kernels() if all_fused else None
        self.decoder = self.kernels.DecoderOps([layer.ops for layer in self.layers]) if all_fused else None

    def _one_call(self, cache) -> bool:
        """Whether this forward runs the decoder as one native call: every layer fused and every
        cache layer a :class:`PreallocatedLayer` (else layer by layer, bitwise the same)."""
        return (self.decoder is not None and len(cache.layers) == len(self.layers)
                and all(type(layer) is PreallocatedLayer for layer in cache.layers))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                keep_last: int | None, return_hidden: int | tuple[int, ...] | None):
        """``ids`` [n], ``position_ids`` [n], ``attention_mask`` None (causal) or [1, 1, n, L]
        additive; returns logits [n or keep_last, V] and, with ``return_hidden``, the hidden
        states [n, E] (after that many layers, or after the final norm for -1; several layers'
        concatenated in the order given for a tuple)."""
        h = self.embed(ids)  # [n, E]
        cos, sin = self.rotary(h[None], position_ids[None])  # [1, n, D] each
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, n, D]
        mask = None if attention_mask is None else attention_mask.float()
        wanted = return_hidden if isinstance(return_hidden, tuple) else (return_hidden,)
        kept: dict[int, torch.Tensor] = {}  # layer count -> hidden states [n, E]
        if self._one_call(cache):
            after = [c for c in wanted if c is not None and c > 0]  # counts of layers (FINAL_HIDDEN is kept below)
            claims = [layer.reserve(self.layers[0].kv_like, h.shape[0]) for layer in cache.layers]
            h, *states = self.kernels.decoder_step(h, self.decoder, [k for k, _, _ in claims], [v for _, v, _ in claims],
                                                   [start for _, _, start in claims], cos, sin, mask, after)
            kept.update(zip(after, states))
        else:
            for index, layer in enumerate(self.layers):
                h = layer(h, index, cos, sin, cache, mask)
                if index + 1 in wanted:
                    kept[index + 1] = h
        h = self.final_norm(h)
        kept[FINAL_HIDDEN] = h
        return forward_outputs(self.head(h if not keep_last else h[-keep_last:]), kept, return_hidden)


def attach_lean(lm) -> None:
    """Run ``lm`` (a ``CausalLM`` whose linears are on native kernels) with the native attention
    and, where the architecture allows, the lean forward (the reason is logged where not)."""
    use_native_attention(lm.model)
    reason = lean_unsupported(lm.model)
    if reason is None:
        lm.use_forward(LeanDecoder(lm.model))
    else:
        log.info("%s: transformers' forward (the lean forward does not apply: %s)", lm.name, reason)
