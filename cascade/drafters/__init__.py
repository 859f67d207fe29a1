"""Drafters: the protocol, the built-in drafters and their stop policies."""

from cascade.drafters.base import Drafter
from cascade.drafters.layer_skip import LayerSkipDrafter
from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.ngram import NGramDrafter
from cascade.drafters.quantized import QuantizedLMDrafter
from cascade.drafters.small_lm import SmallLMDrafter
from cascade.drafters.stopping import ConfidenceStop, FixedK, StopPolicy, ThompsonStop

__all__ = [
    "ConfidenceStop",
    "Drafter",
    "FixedK",
    "LMDrafter",
    "LayerSkipDrafter",
    "NGramDrafter",
    "QuantizedLMDrafter",
    "SmallLMDrafter",
    "StopPolicy",
    "ThompsonStop",
]
