"""``OneLayerHead``: what the Kangaroo exit adapter, cascade's / EAGLE-1/2's draft head and an
EAGLE-3 head share. Each is one decoder layer of the target's family with a one-layer config of
its own (its KV cache: ``new_cache``, ``cache_len``, ``crop``), built for one target (``facts``:
its name and hidden size at least), run on the target's rotary embedding and a causal or tree
mask set up once here (``layer_inputs``), and at inference on the target's device, dtype and
fp16-weight kernels (``for_inference``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from cascade.models.backends.cpu_kernels import FP16WeightLinear, fbgemm_available, use_fp16_weight_linears
from cascade.models.backends.native import NativeFP16Linear, swap_linears
from cascade.models.layers import decoder_parts
from cascade.models.lm import CausalLM


def on_target_kernels(head: nn.Module, lm: CausalLM) -> None:
    """On a target whose LM head runs on fp16 weights (FBGEMM's or cascade's native kernel), run
    ``head``'s linears on that kernel too, its weights rounded to fp16 first (the head is then that
    rounded head, whose distributions are the q it reports); otherwise leave it as it is."""
    target_head = decoder_parts(lm).head
    fbgemm = isinstance(target_head, FP16WeightLinear) and fbgemm_available()
    if fbgemm or isinstance(target_head, NativeFP16Linear):
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.half().float())
        if fbgemm:
            use_fp16_weight_linears(head)
        else:
            swap_linears(head, NativeFP16Linear)


class OneLayerHead(nn.Module):
    """A one-decoder-layer network drafting from the target's states (see the module docstring).
    Subclasses define ``check_target``."""

    config: object  # a one-layer copy of the target's config (the target's is untouched)
    facts: dict  # the target it was built for: "target" (name), "hidden_size", ...

    @property
    def hidden_size(self) -> int:
        return int(self.facts["hidden_size"])

    # ---- cache ------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    # a head's cache is a DynamicCache like a model's: the same length and crop helpers
    cache_len = staticmethod(CausalLM.cache_len)
    crop = staticmethod(CausalLM.crop)

    # ---- the layer's inputs -----------------------------------------------------------------
    def layer_inputs(self, lm: CausalLM, x: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None,
                     attention_mask: torch.Tensor | None):
        """For the layer's input ``x`` [1, n, H] at ``positions`` [n]: the position ids [1, n], the
        target's rotary embedding (cos, sin) there, and the layer's mask: causal over ``cache``
        plus the n positions, or ``attention_mask`` [1, 1, n, cache_len + n] 0 / -inf (a tree
        level, unrolled training)."""
        pos = positions.reshape(1, -1).to(x.device)  # [1, n]
        pe = decoder_parts(lm).rotary(x, position_ids=pos)
        if attention_mask is not None:
            attention_mask = attention_mask.to(x.device, x.dtype)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=pos)
        return pos, pe, mask

    # ---- the target --------------------------------------------------------------------------
    def check_target(self, lm: CausalLM) -> None:
        """Refuse a target this head was not built for."""
        raise NotImplementedError

    def for_inference(self, lm: CausalLM):
        """Move to the target's device and dtype, in eval mode, on the target's fp16-weight kernel
        where its LM head runs on one (``on_target_kernels``); refuses another target first."""
        self.check_target(lm)
        self.to(lm.device, lm.dtype).eval()
        on_target_kernels(self, lm)
        return self
