"""Quantized copies of a model, for drafting.

Methods:
    "int8_dynamic"  CPU. PyTorch's dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``:
                    int8 weights, activations quantized per call, x86/fbgemm kernels) of every
                    ``nn.Linear``, the LM head included. Chosen over torchao because it is the
                    fastest measured here: a 1536x8960 + 8960x1536 MLP on 2 AVX2 cores took
                    1.33 ms per token (fp32 7.7, bf16 4.2, torchao int8 weight-only bf16 9.7,
                    torchao int8 dynamic 15-18 ms; torchao 0.18 also prints load errors for its
                    CUDA extensions at import). Needs an fp32 model.
    "nf4"           CUDA. bitsandbytes 4-bit NF4 through transformers' ``BitsAndBytesConfig``
                    (bf16 compute), applied while loading.
    "auto"          nf4 on CUDA, int8_dynamic on CPU.

The quantized model is a different model: a drafter built on it stays lossless (the target
verifies), it only changes acceptance. Quantization is not cached on disk: dynamic int8
quantization of the 1.5B model takes a few seconds once the fp32 weights are in memory, and the
library has no loading path that skips building them (a saved quantized state dict still needs
the fp32 skeleton to load into).
"""

from __future__ import annotations

import copy
import warnings

import torch

METHODS = ("auto", "int8_dynamic", "nf4")


def resolve_method(method: str, device: torch.device) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; use one of {METHODS}")
    if method == "auto":
        return "nf4" if device.type == "cuda" else "int8_dynamic"
    if method == "nf4" and device.type != "cuda":
        raise ValueError("quantize='nf4' (bitsandbytes 4-bit) needs a CUDA device; on CPU use 'int8_dynamic'")
    if method == "int8_dynamic" and device.type != "cpu":
        raise ValueError("quantize='int8_dynamic' (PyTorch dynamic int8) runs on CPU only; on CUDA use 'nf4'")
    return method


def quantize_int8_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of an fp32 CPU model for a dynamically quantized int8 one (in place)."""
    from torch.ao.quantization import quantize_dynamic

    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("int8_dynamic quantization needs an fp32 model")
    with warnings.catch_warnings():
        # torch 2.13 deprecates the quantized tensor types these modules use; they are still the
        # fastest CPU int8 path here (see the module docstring), so the notice is not repeated.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated", category=DeprecationWarning)
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def quantized_copy(lm, method: str = "auto"):
    """A quantized copy of an already loaded ``CausalLM`` (the original is untouched). Only
    int8_dynamic can quantize a loaded model; nf4 is applied while loading (``load_model(...,
    quantize="nf4")``)."""
    from cascade.models.lm import CausalLM

    method = resolve_method(method, lm.device)
    if method != "int8_dynamic":
        raise ValueError("nf4 quantizes while loading: use load_model(name, quantize='nf4')")
    if any(type(m).__name__ == "OneDNNLinear" for m in lm.model.modules()):
        raise ValueError(f"{lm.name!r} runs oneDNN linears; load a plain copy (load_model(name, quantize='int8_dynamic'))")
    model = copy.deepcopy(lm.model).float()
    return CausalLM(quantize_int8_dynamic(model), lm.tokenizer, f"{lm.name}[{method}]")


def bitsandbytes_config():
    """transformers' BitsAndBytesConfig for NF4 with bf16 compute (CUDA only)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError("quantize='nf4' needs bitsandbytes: pip install bitsandbytes (CUDA machines)") from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
