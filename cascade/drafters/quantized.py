"""Quantized-LM drafter: a small LM drafter whose model is a quantized copy of a given model
(a small LM, or the target itself: "quantized self-drafting")."""

from __future__ import annotations

from cascade.drafters.small_lm import SmallLMDrafter
from cascade.drafters.stopping import StopPolicy
from cascade.models.lm import CausalLM
from cascade.models.loading import load_model, quantized_copy


class QuantizedLMDrafter(SmallLMDrafter):
    kind = "quantized_lm"
    """``model``: a model name/path (loaded quantized with ``quantize``) or a loaded ``CausalLM``
    (copied, then quantized; the original is untouched). ``quantize``: "auto" (nf4 on CUDA;
    on CPU int4_vnni, int8_native or int8_dynamic, whichever this CPU runs fastest), or one of
    ``cascade.models.backends.quantize.METHODS``; see that module."""

    def __init__(
        self,
        model: CausalLM | str,
        quantize: str = "auto",
        device: str | None = None,
        k: int = 4,
        sample: bool = True,
        stop: StopPolicy | None = None,
        stop_below: float | None = None,
        name: str | None = None,
    ) -> None:
        if isinstance(model, CausalLM):
            lm = quantized_copy(model, quantize)
        else:
            lm = load_model(model, "auto_quantized" if quantize == "auto" else quantize, device)
        super().__init__(lm, k=k, sample=sample, stop=stop, stop_below=stop_below, name=name or f"quantized({lm.name})")
