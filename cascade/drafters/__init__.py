"""Drafters: the protocol and the built-in drafters."""

from cascade.drafters.base import Drafter
from cascade.drafters.ngram import NGramDrafter
from cascade.drafters.small_lm import SmallLMDrafter

__all__ = ["Drafter", "NGramDrafter", "SmallLMDrafter"]
