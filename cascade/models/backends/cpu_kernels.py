"""Run a model's linear layers through faster exact CPU kernels: oneDNN fp32, or 16-bit weights
with fp32 arithmetic through FBGEMM.

Why this exists: on CPUs without native bf16 (e.g. AVX2-only AMD EPYC, as on this project's
machines), transformers' default path (``nn.Linear`` -> MKL sgemm, or bf16 emulation) costs
nearly k times one token for a forward over k tokens, which removes the slack speculative
verification relies on. oneDNN's fp32 inner product (the kernel behind
``torch.utils.mkldnn``) has the expected profile (measured on a 1536x8960 projection, 2 threads:
1 row 3.5 ms, 8 rows 7.8 ms, 16 rows 9.5 ms; MKL: 5.2, 27, 27 ms; bf16: 2.2, 12, 24 ms).
``torch.utils.mkldnn.to_mkldnn`` does the same swap but builds TorchScript modules and only
accepts 2-D inputs, hence this small eager module.

``FP16WeightLinear`` (``backend="fp16w"`` in ``load_model``) keeps each weight in fp16 and runs
FBGEMM's fp16-weight GEMM (``torch.ops.quantized.linear_prepack_fp16`` /
``linear_dynamic_fp16``, shipped inside torch): half the bytes of fp32 to stream, fp32
accumulation. Exactness: the weights it multiplies must be the model's. A checkpoint stored in
bf16 converts to fp16 exactly unless a value lies outside fp16's range or below its normal
range with low bits fp16 cannot hold; :func:`fp16_inexact` counts those values and a layer that
has any keeps its exact kernel (logged). Numerics: products and sums in fp32, so the result is
closer to the fp32 product of the canonical weights than transformers' bf16 path.
"""

from __future__ import annotations

import torch
from torch import nn

from cascade.models.backends.exact_fp16 import InexactWeightError, fp16_inexact
from cascade.models.backends.native import swap_linears


class OneDNNLinear(nn.Module):
    """Inference-only replacement for ``nn.Linear`` holding its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_onednn = linear.weight.detach().float().to_mkldnn()
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.bias_onednn = bias.to_mkldnn()

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The weight and bias as a dense ``nn.Linear`` holds them (a missing bias reads as zeros)."""
        return {"weight": self.weight_onednn.to_dense(), "bias": self.bias_onednn.to_dense()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        shape = x.shape
        y = torch._C._nn.mkldnn_linear(x.reshape(-1, shape[-1]).float().contiguous().to_mkldnn(), self.weight_onednn, self.bias_onednn)
        return y.to_dense().reshape(*shape[:-1], self.out_features).to(x.dtype)


class FP16WeightLinear(nn.Module):
    """Inference-only ``nn.Linear`` with fp16 weights and fp32 arithmetic (FBGEMM)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        bad = fp16_inexact(linear.weight)
        if bad:
            raise InexactWeightError(f"{bad} weight values are not exactly representable in fp16")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The weight (and bias) as a dense fp32 ``nn.Linear`` would hold them (exact)."""
        weight, bias = torch.ops.quantized.linear_unpack_fp16(self.packed)
        return {"weight": weight, **({} if bias is None else {"bias": bias})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, shape[-1]).float().contiguous(), self.packed)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def fbgemm_available() -> bool:
    """FBGEMM's fp16-weight GEMM works in this torch build on this CPU."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(2, 2), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 2), packed)
    except (RuntimeError, AttributeError):
        return False
    return True


def use_fp16_weight_linears(model: nn.Module) -> tuple[int, list[str]]:
    """Swap every ``nn.Linear`` of an fp32 CPU model (in place) for :class:`FP16WeightLinear`,
    except those whose weights fp16 cannot hold exactly (they stay exact fp32 linears). Returns
    (swapped count, names kept)."""
    if not fbgemm_available():
        raise RuntimeError("FBGEMM's fp16 GEMM is not available in this torch build / on this CPU")
    return swap_linears(model, FP16WeightLinear)  # InexactWeightError is a ValueError: that layer is kept


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` in ``model`` (in place) for :class:`OneDNNLinear`. Returns the count.

    The model must be an fp32 CPU model used for inference only.
    """
    if not onednn_available():
        raise RuntimeError("oneDNN (mkldnn) is not available in this torch build")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, OneDNNLinear(child))
                swapped += 1
    return swapped
