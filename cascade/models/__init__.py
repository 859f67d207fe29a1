"""Model loading, the packaged zoo, tiny test models and the `CausalLM` wrapper."""

from cascade.models.lm import CausalLM
from cascade.models.devices import resolve_device, resolve_dtype
from cascade.models.loading import load_model
from cascade.models.tiny import perturbed_copy, tiny_llama
from cascade.models.zoo import ZOO, ZooError

__all__ = [
    "CausalLM",
    "ZOO",
    "ZooError",
    "load_model",
    "perturbed_copy",
    "resolve_device",
    "resolve_dtype",
    "tiny_llama",
]
