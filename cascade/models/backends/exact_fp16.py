"""Whether fp16 holds a checkpoint's weights exactly: the condition under which the fp16-weight
kernels (FBGEMM's, cascade's native one) multiply the model's own weights."""

from __future__ import annotations

import torch


def fp16_inexact(weight: torch.Tensor) -> int:
    """How many values of ``weight`` fp16 cannot represent exactly (out of range, or precision
    lost below fp16's normal range)."""
    w = weight.detach().float()
    back = w.half().float()
    return int((back != w).sum())


class InexactWeightError(ValueError):
    pass
