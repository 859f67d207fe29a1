"""Run a model's linear layers through oneDNN on CPU.

Why this exists: on CPUs without native bf16 (e.g. AVX2-only AMD EPYC, as on this project's
machines), transformers' default path (``nn.Linear`` -> MKL sgemm, or bf16 emulation) costs
nearly k times one token for a forward over k tokens, which removes the slack speculative
verification relies on. oneDNN's fp32 inner product (the kernel behind
``torch.utils.mkldnn``) has the expected profile (measured on a 1536x8960 projection, 2 threads:
1 row 3.5 ms, 8 rows 7.8 ms, 16 rows 9.5 ms; MKL: 5.2, 27, 27 ms; bf16: 2.2, 12, 24 ms).
``torch.utils.mkldnn.to_mkldnn`` does the same swap but builds TorchScript modules and only
accepts 2-D inputs, hence this small eager module.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    """Inference-only replacement for ``nn.Linear`` holding its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_onednn = linear.weight.detach().float().to_mkldnn()
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.bias_onednn = bias.to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        shape = x.shape
        y = torch._C._nn.mkldnn_linear(x.reshape(-1, shape[-1]).float().contiguous().to_mkldnn(), self.weight_onednn, self.bias_onednn)
        return y.to_dense().reshape(*shape[:-1], self.out_features).to(x.dtype)


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
