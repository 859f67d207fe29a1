"""`Backend`: how a loaded model holds and multiplies its weights, as one value.

``load_model(name, backend=...)`` takes a backend's name (or a ``Backend``, or a torch dtype),
resolves "auto" once, loads, applies the backend in one place (:func:`cascade.models.loading`)
and hands the value to the ``CausalLM``, where summaries read it (``lm.backend.name``).

Names (``BACKENDS``):

- ``native``: the checkpoint's weights held exactly in fp16, fp32 arithmetic on cascade's
  row-invariant kernels (``cascade.models.backends.native``), the lean forward (CPU).
- ``fp16w``: the same weights through FBGEMM's fp16-weight GEMM (CPU; not row-invariant).
- ``onednn``: fp32 weights, oneDNN linears (CPU).
- ``float32``, ``float64``, ``bfloat16``, ``float16``: transformers' modules in that dtype.
- quantized weight formats, for drafters: ``int8_dynamic``, ``int8_native``, ``int8_vnni``,
  ``int4_native``, ``int4_vnni`` (CPU, ``cascade.models.backends.quantize``), ``nf4`` (CUDA, bitsandbytes).
- ``gguf``: the model's GGUF file's own blocks (k-quants and the legacy formats), each weight
  exactly as the ``gguf`` reference dequantizes it, fp32 arithmetic on cascade's row-invariant
  kernels, the lean forward (CPU; ``cascade.models.backends.gguf_weights``): a zoo model or a ``.gguf``
  path. ``gguf_q8``: the same with the Q4_K / Q6_K layers multiplying activations quantized to
  int8 per 256 (integer sums: llama.cpp's kind of arithmetic; row-invariant).
- ``auto``: bf16 on CUDA; on CPUs ``native`` where the extension builds, else ``fp16w``, else
  bf16 (native bf16 CPUs) or ``onednn`` (:func:`auto_backend`); for a quantized load ("auto"
  quantization) the format this CPU runs fastest (``cascade.models.backends.quantize.resolve_method``).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str  # a key of BACKENDS
    dtype: torch.dtype  # the dtype transformers loads the parameters in
    linears: str | None  # what replaces nn.Linear: "native_fp16", "fbgemm_fp16", "onednn", a quantizer; None: torch's
    device: str | None = None  # the only device type it runs on (None: any)

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def from_gguf_file(self) -> bool:
        """Whether the weights are a GGUF file's own blocks (``gguf``, ``gguf_q8``): applied from
        the file, not from the loaded modules."""
        return self.linears in ("gguf", "gguf_q8")

    def __str__(self) -> str:
        return self.name


QUANTIZED = ("int8_dynamic", "int8_native", "int8_vnni", "int4_native", "int4_vnni", "nf4")
BACKENDS: dict[str, Backend] = {
    "native": Backend("native", torch.float32, "native_fp16", "cpu"),
    "fp16w": Backend("fp16w", torch.float32, "fbgemm_fp16", "cpu"),
    "onednn": Backend("onednn", torch.float32, "onednn", "cpu"),
    **{str(d).removeprefix("torch."): Backend(str(d).removeprefix("torch."), d, None)
       for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)},
    **{q: Backend(q, torch.float32, q, "cpu") for q in QUANTIZED if q != "nf4"},
    "nf4": Backend("nf4", torch.bfloat16, "nf4", "cuda"),
    "gguf": Backend("gguf", torch.float32, "gguf", "cpu"),
    "gguf_q8": Backend("gguf_q8", torch.float32, "gguf_q8", "cpu"),
}
_ALIASES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16", "float": "float32",
            "double": "float64", "half": "float16"}


def backend_named(spec: "str | torch.dtype | Backend", device: torch.device) -> Backend:
    """The ``Backend`` a spec names on ``device`` ("auto" resolved; see the module docstring)."""
    if isinstance(spec, Backend):
        backend = spec
    elif isinstance(spec, torch.dtype):
        backend = BACKENDS[str(spec).removeprefix("torch.")] if str(spec).removeprefix("torch.") in BACKENDS else None
        if backend is None:
            raise ValueError(f"backend: no backend holds weights in {spec}")
    elif spec == "auto":
        backend = auto_backend(device)
    else:
        key = _ALIASES.get(str(spec).removeprefix("torch."), str(spec).removeprefix("torch."))
        if key == "auto_quantized":
            from cascade.models.backends.quantize import resolve_method

            key = resolve_method("auto", device)
        if key not in BACKENDS:
            raise ValueError(f"unknown backend {spec!r}; one of auto, auto_quantized, {', '.join(BACKENDS)}")
        backend = BACKENDS[key]
    if backend.device is not None and backend.device != device.type:
        raise ValueError(f"backend {backend.name!r} runs on {backend.device} only, not {device}")
    return backend


def auto_backend(device: torch.device) -> Backend:
    """``backend="auto"``: bf16 on CUDA; on CPUs cascade's native fp16-weight kernel (exact,
    row-invariant, at the bandwidth floor for 1-4 rows) where it builds, else FBGEMM's fp16w (the
    reason logged), measured fastest of torch's kernels for the 1-12 token forwards decoding and
    verification run (``experiments/forward_cost.py``, 1.5B target, 2 threads, bf16-capable EPYC:
    97 ms per token vs 222 ms bf16 and 208 ms fp32+oneDNN; 8 tokens 186 ms vs 238 and 394);
    otherwise bf16 on CPUs with native bf16, else fp32 with oneDNN linears (on an AVX2-only CPU
    a 16-token forward costs 8.9x one token in bf16, 2.3x there)."""
    from cascade.models.backends.cpu_kernels import fbgemm_available
    from cascade.models.backends.native import native_kernels, unavailable_reason

    if device.type == "cuda":
        return BACKENDS["bfloat16"]
    if native_kernels() is not None:
        return BACKENDS["native"]
    if fbgemm_available():
        log.info("backend=auto: FBGEMM's fp16w, since cascade's native kernels are unavailable (%s)", unavailable_reason())
        return BACKENDS["fp16w"]
    if cpu_has_native_bf16():
        return BACKENDS["bfloat16"]
    return BACKENDS["onednn"]


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def from_legacy(dtype, onednn: bool | None, quantize: str | None) -> str | torch.dtype | None:
    """The backend the retired arguments ``dtype`` / ``onednn`` / ``quantize`` name (a
    ``DeprecationWarning`` says so), or None when none was given."""
    given = {k: v for k, v in (("dtype", dtype), ("onednn", onednn), ("quantize", quantize)) if v not in (None, False)}
    if not given:
        return None
    warnings.warn(f"load_model({', '.join(f'{k}=' for k in given)}...) is deprecated: pass backend= "
                  "(cascade.models.backends.backend.BACKENDS)", DeprecationWarning, stacklevel=3)
    if quantize is not None:
        if onednn:
            raise ValueError("quantize and onednn are exclusive (both replace the linear layers)")
        return "auto_quantized" if quantize == "auto" else quantize
    if onednn:
        if dtype not in (None, "auto", torch.float32, "float32", "fp32"):
            raise ValueError("onednn=True needs dtype float32 on the CPU")
        return "onednn"
    return dtype
