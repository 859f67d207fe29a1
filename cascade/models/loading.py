"""Load a causal LM from a zoo name, a Hugging Face id, a local directory or a GGUF file."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade.models import zoo
from cascade.models.backends.backend import QUANTIZED, Backend, backend_named, from_legacy
from cascade.models.backends.cpu_kernels import use_fp16_weight_linears, use_onednn_linears
from cascade.models.devices import resolve_device
from cascade.models.backends.gguf_weights import use_gguf_weights
from cascade.models.backends.lean import attach_lean
from cascade.models.lm import CausalLM
from cascade.models.backends.native import NativeFP16Linear, native_kernels, swap_linears, unavailable_reason
from cascade.models.backends.quantize import bitsandbytes_config, dense_linears, quantize_int8_dynamic, quantize_native
from cascade.models.tiny import tiny_bpe_tokenizer, tiny_llama

log = logging.getLogger(__name__)


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
def shared_models() -> Iterator[dict[tuple, CausalLM]]:
    """Inside the block, :func:`load_model` returns one model per distinct set of arguments: the
    methods of a run that name the same drafter model (the 0.5B of a chain and of a cascade, the
    int8 0.5B of a chain and of DyTC) hold one copy instead of one each. Models hold no decoding
    state (each drafter keeps its own caches), so sharing changes no result; it bounds a
    many-method benchmark's memory (each 0.5B copy also keeps a 0.5 GB fp32 embedding).
    Yields the models loaded in the block (``load_model``'s arguments -> model)."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield _shared
    finally:
        _shared = outer


def load_model(
    name_or_path: str | Path,
    backend: str | torch.dtype | Backend = "auto",
    device: str | torch.device | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    onednn: bool | None = None,
    quantize: str | None = None,
) -> CausalLM:
    """Load a model usable as target or inside a drafter.

    ``name_or_path``: a zoo name (``python -m cascade.models list``; fetched on first use), a
    ``.gguf`` file, a local directory with a transformers checkpoint, a Hugging Face id
    (needs a reachable hub or a populated HF cache), or ``tiny:SEED`` (a tiny random Llama with
    a 256-token byte-level vocabulary and 4 layers, for debug runs), or ``tiny-bpe:SEED`` (the same
    with a 320-token byte-level BPE tokenizer of its own: a drafter from "another family").

    ``backend``: how the weights are held and multiplied, one of ``cascade.models.backends.backend.BACKENDS``
    (native, fp16w, onednn, float32 / float64 / bfloat16 / float16, the quantized
    formats for drafters), a torch dtype, or "auto" (:func:`cascade.models.backends.backend.auto_backend`;
    "auto_quantized": the quantized format this CPU runs fastest). The loaded model's
    ``backend`` says which ran. ``dtype`` / ``onednn`` / ``quantize``: the retired way of saying
    the same (a ``DeprecationWarning``).
    """
    device = resolve_device(device)  # (None and the device it resolves to are one key)
    legacy = from_legacy(dtype, onednn, quantize)
    chosen = backend_named(legacy if legacy is not None else backend, device)
    key = (str(name_or_path), chosen.name, str(device))
    if _shared is not None and key in _shared:
        return _shared[key]
    gguf_file = gguf_source(name_or_path) if chosen.from_gguf_file else None  # checked before loading
    lm = _load(name_or_path, chosen, device)
    apply_backend(lm, chosen, gguf_file)
    if _shared is not None:
        _shared[key] = lm
    return lm


def quantized_copy(lm: CausalLM, method: str = "auto") -> CausalLM:
    """A copy of an already loaded ``CausalLM`` on a quantized backend (the original is
    untouched): its swapped kernels turned back into the plain fp32 linears they hold, then
    :func:`apply_backend`, as ``load_model(name, backend=method)`` applies it. nf4 quantizes while
    loading, so it has no copy."""
    backend = backend_named("auto_quantized" if method == "auto" else method, lm.device)
    if not backend.quantized or backend.name == "nf4":
        raise ValueError(f"a quantized copy takes a CPU quantized format ({', '.join(q for q in QUANTIZED if q != 'nf4')}), "
                         f"not {method!r} (nf4 quantizes while loading: load_model(name, backend='nf4'))")
    if any(type(m).__name__ == "OneDNNLinear" for m in lm.model.modules()):  # oneDNN tensors do not deep-copy
        raise ValueError(f"{lm.name!r} runs oneDNN linears; load a plain copy (load_model(name, backend={backend.name!r}))")
    model = copy.deepcopy(lm.model).float()
    dense_linears(model)
    copy_lm = CausalLM(model, lm.tokenizer, lm.name, backend=backend)
    apply_backend(copy_lm, backend)
    return copy_lm


def apply_backend(lm: CausalLM, backend: Backend, gguf_file: Path | None = None) -> None:
    """Replace ``lm``'s linear layers as ``backend`` says (the one place a backend is applied;
    transformers already loaded the parameters in ``backend.dtype``). A GGUF backend replaces
    every weight by ``gguf_file``'s (:func:`gguf_source`)."""
    kind = backend.linears
    if kind is None or kind == "nf4":  # torch's modules (nf4: bitsandbytes quantized while loading)
        return
    if backend.from_gguf_file:
        if gguf_file is None:
            raise ValueError(f"backend {kind!r} reads a GGUF file (load_model(zoo name or .gguf path, backend={kind!r}))")
        use_gguf_weights(lm.model, gguf_file, int8_activations=kind == "gguf_q8")
        attach_lean(lm)
        return
    if kind == "onednn":
        use_onednn_linears(lm.model)
    elif kind in ("fbgemm_fp16", "native_fp16"):
        if kind == "fbgemm_fp16":
            swapped, kept = use_fp16_weight_linears(lm.model)
        elif native_kernels() is None:
            raise RuntimeError(f"backend 'native': cascade's native kernels are unavailable ({unavailable_reason()}); "
                               "use backend='fp16w'")
        else:
            swapped, kept = swap_linears(lm.model, NativeFP16Linear)
            attach_lean(lm)
        log.info("%s: %d linear layers on %s fp16 weights", lm.name, swapped, "FBGEMM" if kind == "fbgemm_fp16" else "native")
        if kept:
            log.warning("%s: %d layers keep fp32 (weights fp16 cannot hold exactly): %s", lm.name, len(kept), kept[:5])
    elif kind == "int8_dynamic":
        quantize_int8_dynamic(lm.model)
    else:  # cascade's native quantized formats
        swapped, kept = quantize_native(lm.model, kind)
        log.info("%s: %d linear layers on %s (%d kept fp32: %s)", lm.name, swapped, kind, len(kept), kept[:3])
        attach_lean(lm)
    if backend.quantized:
        lm.name = f"{lm.name}[{backend.name}]"


def gguf_source(name_or_path: str | Path) -> Path:
    """The GGUF file the GGUF backends read for ``name_or_path``: a zoo model's (fetched), or the
    path itself."""
    text = str(name_or_path)
    if text in zoo.ZOO:
        return zoo.fetch_gguf(text)
    path = Path(text).expanduser()
    if text.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    raise ValueError(f"a GGUF backend needs a zoo model ({', '.join(sorted(zoo.ZOO))}) or a .gguf file, got {text!r}")


def _load(name_or_path: str | Path, backend: Backend, device: torch.device) -> CausalLM:
    """The model as transformers loads it in ``backend.dtype`` (nf4: quantized while loading),
    its ``backend`` set; :func:`apply_backend` does the rest."""
    lm = _load_modules(name_or_path, backend, device)
    lm.backend = backend
    return lm


def _load_modules(name_or_path: str | Path, backend: Backend, device: torch.device) -> CausalLM:
    text, dtype = str(name_or_path), backend.dtype
    path = Path(text).expanduser()
    if backend.name == "nf4":  # applied by transformers while loading: the source must be a checkpoint directory
        source = zoo.fetch(text) if text in zoo.ZOO else path
        if not Path(source).is_dir():
            raise ValueError(f"backend 'nf4' needs a zoo name or a checkpoint directory, got {text!r}")
        lm = _from_pretrained(source, dtype, device, quantization_config=bitsandbytes_config())
        lm.name = text
        return lm
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
