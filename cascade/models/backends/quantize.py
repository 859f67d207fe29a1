"""Quantized copies of a model, for drafting.

Methods:
    "int8_dynamic"  CPU. PyTorch's dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``:
                    int8 weights, activations quantized per call, x86/fbgemm kernels) of every
                    ``nn.Linear``, the LM head included. Chosen over torchao because it is the
                    fastest measured here: a 1536x8960 + 8960x1536 MLP on 2 AVX2 cores took
                    1.33 ms per token (fp32 7.7, bf16 4.2, torchao int8 weight-only bf16 9.7,
                    torchao int8 dynamic 15-18 ms; torchao 0.18 also prints load errors for its
                    CUDA extensions at import). Needs an fp32 model.
    "int8_native"   CPU. cascade's own weight-only kernel (``cascade.models.backends.native``): int8 weights
                    with one scale per output channel, fp32 activations and arithmetic; reads a
                    quarter of fp32's bytes and keeps the activations unrounded.
    "int8_vnni"     CPU with AVX-512 VNNI. The same int8 weights times int8 activations quantized
                    per row at each call, int32 sums (``NativeInt8VNNILinear``): several rows cost
                    about one (tree levels, catch-up forwards); activations rounded like
                    int8_dynamic's.
    "int4_native"   CPU. The same with int4 weights, one scale per output column and group of 64
                    along K (an eighth of fp32's bytes); a layer whose K is not a multiple of 64
                    keeps fp32.
    "int4_vnni"     CPU with AVX-512 VNNI or AVX2. int4_native's weights times int8 activations
                    quantized per row at each call, int32 sums per group (``NativeInt4VNNILinear``;
                    vpdpbusd, or on AVX2 vpmaddubsw + vpmaddwd: the same sums, the same result): the
                    same bytes as int4_native without its per-weight unpacking and fp32
                    multiply-adds, which bound int4_native at ~2x its bytes' time on one row;
                    activations rounded.
    "nf4"           CUDA. bitsandbytes 4-bit NF4 through transformers' ``BitsAndBytesConfig``
                    (bf16 compute), applied while loading.
    "auto"          nf4 on CUDA. On CPU the fastest drafter measured (docs/results.md, bench/kernels;
                    docs/backends.md for the AVX2-only EPYC): int4_vnni where the native kernels
                    build (AVX-512 VNNI or AVX2), int8_native should a build lack the int4 x int8
                    kernel, int8_dynamic where they do not build.

The quantized model is a different model: a drafter built on it stays lossless (the target
verifies), it only changes acceptance. Quantization is not cached on disk: dynamic int8
quantization of the 1.5B model takes a few seconds once the fp32 weights are in memory, and the
library has no loading path that skips building them (a saved quantized state dict still needs
the fp32 skeleton to load into).
"""

from __future__ import annotations

import warnings

import torch

from cascade.models.backends.lean import attach_lean
from cascade.models.backends.native import (NativeInt4Linear, NativeInt4VNNILinear, NativeInt8Linear, NativeInt8VNNILinear, native_kernels,
                                   swap_linears, unavailable_reason)

METHODS = ("auto", "int8_dynamic", "int8_native", "int8_vnni", "int4_native", "int4_vnni", "nf4")
CPU_METHODS = ("int8_dynamic", "int8_native", "int8_vnni", "int4_native", "int4_vnni")


def resolve_method(method: str, device: torch.device) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; use one of {METHODS}")
    if method == "auto":
        return "nf4" if device.type == "cuda" else auto_cpu_method()
    if method == "nf4" and device.type != "cuda":
        raise ValueError("quantize='nf4' (bitsandbytes 4-bit) needs a CUDA device; on CPU use 'int8_dynamic'")
    if method in CPU_METHODS and device.type != "cpu":
        raise ValueError(f"quantize={method!r} runs on CPU only; on CUDA use 'nf4'")
    return method


def auto_cpu_method() -> str:
    """What ``quantize="auto"`` is on this CPU (see the module docstring)."""
    ext = native_kernels()
    if ext is None:
        return "int8_dynamic"
    return "int4_vnni" if ext.int8_dot_isa() != "none" else "int8_native"


# method -> the native linear it swaps in (weight-only int8 / int4, or int8 x int8 with VNNI)
NATIVE_QUANTIZERS = {"int8_native": NativeInt8Linear, "int8_vnni": NativeInt8VNNILinear, "int4_native": NativeInt4Linear,
                     "int4_vnni": NativeInt4VNNILinear}


def quantize_native(model: torch.nn.Module, method: str) -> tuple[int, list[str]]:
    """Swap every ``nn.Linear`` of an fp32 CPU model (in place) for ``method``'s native linear;
    a layer it refuses (int4: K not a multiple of the group) keeps fp32. Returns (swapped, kept)."""
    if native_kernels() is None:
        raise RuntimeError(f"cascade's native kernels are unavailable ({unavailable_reason()}); use 'int8_dynamic'")
    return swap_linears(model, NATIVE_QUANTIZERS[method])


def dense_linears(model: torch.nn.Module) -> int:
    """Replace (in place) every swapped linear layer (a module with ``dense_state()``: fp16w,
    oneDNN, native) by the plain fp32 ``nn.Linear`` it holds, so that a quantizer sees
    the model's own weights. Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if hasattr(child, "dense_state") and isinstance(getattr(child, "in_features", None), int):
                state = child.dense_state()
                lin = torch.nn.utils.skip_init(torch.nn.Linear, child.in_features, child.out_features, bias="bias" in state)
                lin.load_state_dict(state)  # (skip_init: no random initialisation of weights overwritten here)
                setattr(parent, name, lin)
                count += 1
    return count


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


def bitsandbytes_config():
    """transformers' BitsAndBytesConfig for NF4 with bf16 compute (CUDA only)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError("quantize='nf4' needs bitsandbytes: pip install bitsandbytes (CUDA machines)") from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
