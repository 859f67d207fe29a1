"""Drafters: the protocol, the built-in drafters and their stop policies."""

from cascade.drafters.base import ChecksTarget, Drafter, DraftStart, Outcome, SharesCache
from cascade.drafters.cross_tokenizer import CrossTokenizerDrafter
from cascade.drafters.draft_head import DraftHeadDrafter
from cascade.drafters.frequent_head import frequent_head
from cascade.drafters.layer_skip import LayerSkipDrafter
from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.ngram import NGramDrafter
from cascade.drafters.quantized import QuantizedLMDrafter
from cascade.drafters.recycling import TokenRecyclingDrafter
from cascade.drafters.small_lm import SmallLMDrafter
from cascade.drafters.stopping import ConfidenceStop, FixedK, StopPolicy, ThompsonStop
from cascade.drafters.suffix import Datastore, SuffixDrafter

__all__ = [
    "ChecksTarget",
    "ConfidenceStop",
    "CrossTokenizerDrafter",
    "Datastore",
    "DraftHeadDrafter",
    "DraftStart",
    "Drafter",
    "FixedK",
    "LMDrafter",
    "LayerSkipDrafter",
    "NGramDrafter",
    "Outcome",
    "QuantizedLMDrafter",
    "SharesCache",
    "SmallLMDrafter",
    "StopPolicy",
    "SuffixDrafter",
    "ThompsonStop",
    "TokenRecyclingDrafter",
    "frequent_head",
]
