"""Load a causal LM from a zoo name, a Hugging Face id, a local directory or a GGUF file."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade.models import zoo
from cascade.models.cpu_kernels import (ROW_BUCKETS, KernelPlan, fbgemm_available, use_dispatch_linears, use_fp16_weight_linears,
                                        use_onednn_linears)
from cascade.models.devices import resolve_device, resolve_dtype
from cascade.models.lean import attach_lean
from cascade.models.lm import CausalLM
from cascade.models.native import NativeFP16Linear, native_kernels, swap_linears, unavailable_reason
from cascade.models.quantize import NATIVE_QUANTIZERS, bitsandbytes_config, quantize_int8_dynamic, quantize_native, resolve_method
from cascade.models.tiny import tiny_bpe_tokenizer, tiny_llama

log = logging.getLogger(__name__)


def kernel_plan_path() -> Path:
    """Where the per-(shape, rows) kernel calibration of this CPU is cached: keyed by the CPU
    model, the thread count and the torch version (what the timings depend on), shared by every
    model (a plan is per weight shape, not per model)."""
    import re
    from importlib.metadata import version

    name = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        name = m.group(1) if m else name
    except OSError:
        pass
    name += "-bf16" if cpu_has_native_bf16() else ""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
    return zoo.cache_root() / "kernel_plans" / f"{slug}-t{torch.get_num_threads()}-torch{version('torch')}.json"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_backend(device: torch.device) -> tuple[torch.dtype | str, bool]:
    """(dtype, onednn) for ``dtype="auto"``: bf16 on CUDA; on CPUs cascade's native fp16-weight
    kernel ("native": the checkpoint's weights in fp16, fp32 arithmetic, row-invariant, at the
    bandwidth floor for 1-4 rows; ``cascade.models.native``) where it builds, else fp16 weights
    through FBGEMM ("fp16w", the reason logged), measured fastest of torch's kernels for the 1-12
    token forwards decoding and verification run (``experiments/forward_cost.py``, 1.5B target, 2
    threads, bf16-capable EPYC: 97 ms per token vs 222 ms bf16 and 208 ms fp32+oneDNN; 8 tokens
    186 ms vs 238 and 394); otherwise bf16 on CPUs with native bf16, else fp32 with oneDNN
    linears (on an AVX2-only CPU a 16-token forward costs 8.9x one token in bf16, 2.3x there)."""
    if device.type == "cuda":
        return torch.bfloat16, False
    if native_kernels() is not None:
        return "native", False
    if fbgemm_available():
        log.info("dtype=auto: FBGEMM's fp16w, since cascade's native kernels are unavailable (%s)", unavailable_reason())
        return "fp16w", False
    if cpu_has_native_bf16():
        return torch.bfloat16, False
    return torch.float32, True


def _from_pretrained(source: str | Path, dtype: torch.dtype, device: torch.device, **kwargs) -> CausalLM:
    if "quantization_config" in kwargs:  # bitsandbytes places the weights itself
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map={"": device}, **kwargs).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    except (OSError, ValueError) as exc:  # a weights-only directory is still usable with token ids
        log.warning("no tokenizer for %s (%s); the model works on token ids only", source, exc)
        tokenizer = None
    return CausalLM(model=model, tokenizer=tokenizer, name=str(source))


_shared: dict[tuple, CausalLM] | None = None  # load_model's arguments -> its model, inside shared_models()


@contextmanager
def shared_models() -> Iterator[None]:
    """Inside the block, :func:`load_model` returns one model per distinct set of arguments: the
    methods of a run that name the same drafter model (the 0.5B of a chain and of a cascade, the
    int8 0.5B of a chain and of DyTC) hold one copy instead of one each. Models hold no decoding
    state (each drafter keeps its own caches), so sharing changes no result; it bounds a
    many-method benchmark's memory (each 0.5B copy also keeps a 0.5 GB fp32 embedding)."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        _shared = outer


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    onednn: bool = False,
    quantize: str | None = None,
) -> CausalLM:
    """Load a model usable as target or inside a drafter.

    ``name_or_path``: a zoo name (``python -m cascade.models list``; fetched on first use), a
    ``.gguf`` file, a local directory with a transformers checkpoint, a Hugging Face id
    (needs a reachable hub or a populated HF cache), or ``tiny:SEED`` (a tiny random Llama with
    a 256-token byte-level vocabulary and 4 layers, for debug runs), or ``tiny-bpe:SEED`` (the same
    with a 320-token byte-level BPE tokenizer of its own: a drafter from "another family").

    ``onednn=True`` (fp32 on CPU only) runs the linear layers through oneDNN, whose cost grows
    far less with the number of tokens per forward on CPUs without native bf16; see
    ``cascade.models.cpu_kernels``. ``dtype="fp16w"`` (CPU only) keeps the linear layers'
    weights in fp16 and multiplies in fp32 through FBGEMM (a layer whose weights fp16 cannot hold
    exactly keeps fp32; logged). ``dtype="native"`` (CPU only) does the same through cascade's own
    row-invariant kernel (``cascade.models.native``; built on first use). ``dtype="auto"`` (the
    default) picks the backend (:func:`auto_backend`).

    ``dtype="dispatch"`` (CPU only) runs each linear layer, per forward, through the exact kernel
    that a calibration on this CPU found fastest for its shape and the forward's row count
    (FBGEMM fp16 weights or oneDNN fp32; ``cpu_kernels.use_dispatch_linears``), cached in
    :func:`kernel_plan_path` and logged; a layer keeps a second copy of its weight only where a
    second kernel wins some row count.

    ``quantize`` ("auto", "int8_dynamic", "int8_native", "int8_vnni", "int4_native" or "int4_vnni" on CPU, "nf4" on CUDA;
    see ``cascade.models.quantize``) loads a quantized copy, for drafters. The CPU methods load
    fp32 whatever ``dtype`` says.
    """
    device = resolve_device(device)  # (None and the device it resolves to are one key)
    key = (str(name_or_path), str(dtype), str(device), bool(onednn), quantize)
    if _shared is not None and key in _shared:
        return _shared[key]
    lm = _load_model(name_or_path, dtype, device, onednn, quantize)
    if _shared is not None:
        _shared[key] = lm
    return lm


def _load_model(name_or_path: str | Path, dtype: str | torch.dtype, device: torch.device, onednn: bool,
                quantize: str | None) -> CausalLM:
    if dtype == "auto":  # (a quantized load chooses its own dtype)
        dtype, onednn = auto_backend(device) if quantize is None else (torch.float32, False)
    backend = dtype if dtype in ("fp16w", "dispatch", "native") else None
    if backend is not None:
        if device.type != "cpu" or onednn or quantize is not None:
            raise ValueError(f"dtype={backend!r} is a CPU backend of its own (not with onednn, quantize or CUDA)")
        dtype = torch.float32
    dtype = resolve_dtype(dtype)
    if onednn and (dtype != torch.float32 or device.type != "cpu"):
        raise ValueError("onednn=True needs dtype float32 on the CPU")
    if quantize is not None:
        if onednn:
            raise ValueError("quantize and onednn are exclusive (both replace the linear layers)")
        return _load_quantized(name_or_path, resolve_method(quantize, device), device)
    lm = _load(name_or_path, dtype, device)
    if onednn:
        use_onednn_linears(lm.model)
    if backend == "dispatch":
        plan = KernelPlan.load(kernel_plan_path())
        chosen = use_dispatch_linears(lm.model, plan, log=lambda key, ms: log.info("calibrated %s: %s ms", key, ms))
        for key, choice in chosen.items():
            log.info("%s: linear %s runs %s", lm.name, key,
                     ", ".join(f"<={b} rows {k}" for b, k in zip(ROW_BUCKETS[:-1] + ("inf",), choice)))
        log.info("kernel plan: %s", plan.path)
    if backend in ("fp16w", "native"):
        if backend == "fp16w":
            swapped, kept = use_fp16_weight_linears(lm.model)
        elif native_kernels() is None:
            raise RuntimeError(f"dtype='native': cascade's native kernels are unavailable ({unavailable_reason()}); use dtype='fp16w'")
        else:
            swapped, kept = swap_linears(lm.model, NativeFP16Linear)
            attach_lean(lm)
        log.info("%s: %d linear layers on %s fp16 weights", lm.name, swapped, "FBGEMM" if backend == "fp16w" else "native")
        if kept:
            log.warning("%s: %d layers keep fp32 (weights fp16 cannot hold exactly): %s", lm.name, len(kept), kept[:5])
    return lm


def _load_quantized(name_or_path: str | Path, method: str, device: torch.device) -> CausalLM:
    if method == "int8_dynamic":
        lm = _load(name_or_path, torch.float32, device)
        quantize_int8_dynamic(lm.model)
    elif method in NATIVE_QUANTIZERS:
        lm = _load(name_or_path, torch.float32, device)
        swapped, kept = quantize_native(lm.model, method)
        log.info("%s: %d linear layers on %s (%d kept fp32: %s)", lm.name, swapped, method, len(kept), kept[:3])
        attach_lean(lm)
    else:  # nf4 is applied by transformers while loading: the source must be a checkpoint directory
        text = str(name_or_path)
        source = zoo.fetch(text) if text in zoo.ZOO else Path(text).expanduser()
        if not Path(source).is_dir():
            raise ValueError(f"quantize='nf4' needs a zoo name or a checkpoint directory, got {text!r}")
        lm = _from_pretrained(source, torch.bfloat16, device, quantization_config=bitsandbytes_config())
        lm.name = text
    lm.name = f"{lm.name}[{method}]"
    return lm


def _load(name_or_path: str | Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text.startswith("tiny:"):
        return tiny_llama(vocab_size=256, num_layers=4, seed=int(text[5:]), dtype=dtype, device=device, name=text)
    if text.startswith("tiny-bpe:"):  # another tokenizer than tiny:SEED's bytes (cross-tokenizer drafting)
        seed = int(text[9:])
        return tiny_llama(num_layers=4, seed=seed, dtype=dtype, device=device, name=text,
                          tokenizer=tiny_bpe_tokenizer(320, seed))
    if text in zoo.ZOO:
        lm = _from_pretrained(zoo.fetch(text), dtype, device)
        lm.name = text
        return lm
    if text.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return _from_pretrained(path.parent, dtype, device, gguf_file=path.name)
    if path.is_dir():
        return _from_pretrained(path, dtype, device)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ValueError(
            f"unknown model {text!r}: not a zoo name ({', '.join(sorted(zoo.ZOO))}), "
            "not a .gguf file, not a local directory, not a Hugging Face id (org/name)"
        )
    try:
        return _from_pretrained(text, dtype, device)
    except OSError as exc:
        raise ValueError(f"could not load Hugging Face model {text!r} (is the hub reachable?): {exc}") from exc
