"""cascade: lossless speculative decoding with composable drafters."""

from cascade.models import CausalLM, load_model
from cascade.types import DraftBlock, SamplingConfig, StepRecord, VerifyResult

__all__ = ["CausalLM", "DraftBlock", "SamplingConfig", "StepRecord", "VerifyResult", "load_model"]

from cascade.decode import Generation, generate  # noqa: E402  (after the light imports above)

__all__ += ["Generation", "generate"]
