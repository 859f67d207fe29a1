"""cascade's own CPU kernels (``csrc/``; the design notes in ``linear.cpp``): weight-only linear
layers for the 1-32 rows decoding and verification multiply, fp32 arithmetic.

Why a C++ extension: torch ships no CPU kernel that reads a 16-bit (or lower) weight once per
call for 2-32 rows. FBGEMM's fp16-weight GEMM costs more with every row, oneDNN and MKL need
fp32 weights (twice the bytes), bf16 rounds the activations, ``torch.compile`` folds an fp32
weight and calls MKL (docs/backends.md has the measurements). The kernels here convert each
weight tile once and multiply it into every row; two threads split the output columns.

- :class:`NativeFP16Linear` (``load_model(name, backend="native")``): the checkpoint's weights held
  exactly in fp16, fp32 arithmetic. **Row-invariant**: row i of an M-row call is bitwise the
  1-row call on row i (every output is the same sequential fp32 FMA chain over K whatever the
  row count), so a k-token verification forward multiplies exactly as k one-token steps do.
  Error against the exact product: ``|y - x.w| <= gamma_K * sum_k |x_k w_k|``,
  ``gamma_K = K u / (1 - K u)``, ``u = 2^-24`` (:func:`fp32_sum_bound`).
- :class:`NativeInt8Linear`, :class:`NativeInt4Linear` (``backend="int8_native"`` /
  ``"int4_native"``): weight-only quantized copies for drafters (a quarter / an eighth of fp32's
  bytes; symmetric int8 per output channel, int4 per group of 64 along K).
- :class:`NativeInt8VNNILinear`, :class:`NativeInt4VNNILinear` (``"int8_vnni"`` / ``"int4_vnni"``,
  AVX-512 VNNI): the same weights times int8 activations quantized per row at each call, int32
  sums (vpdpbusd); not exact, which a drafter may be.

The extension is built on first use with ``torch.utils.cpp_extension.load`` (g++, a minute on
2 cores) and cached under ``$CASCADE_CACHE/native/`` per torch version and source hash; it is
never built at install time (under pip's build isolation that would fetch another torch).
Where it cannot be built or run (no compiler, a CPU without AVX2 + FMA + F16C, not x86, or
``CASCADE_NATIVE=0``), :func:`native_kernels` returns None and :func:`unavailable_reason` says
why; ``backend="auto"`` then falls back to FBGEMM's ``fp16w`` and logs the reason.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch
from torch import nn

from cascade.models.backends.build_lock import DEFAULT_TIMEOUT_S, build_lock
from cascade.models.backends.exact_fp16 import InexactWeightError, fp16_inexact

log = logging.getLogger(__name__)

PANEL = 32  # output columns per packed panel (the kernels' NC)
INT4_GROUP = 64  # K values per int4 scale
CSRC = Path(__file__).with_name("csrc")
# one file per concern (kernels.h: the shared layout, loops and checks; linear, int8_dot,
# attention, norm_rope, decoder, bindings); every file of csrc/ is in the build's hash
SOURCES = sorted(CSRC.glob("*.cpp"))
# -ffp-contract=off: no multiply-add the source does not spell out is fused (the kernels' stated
# order of operations, and so their row invariance, must not depend on the compiler's choices)
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]

_state: dict[str, object] = {}


def _build_dir() -> Path:
    from cascade.models import zoo

    files = b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h"))
    digest = hashlib.sha256(files + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return zoo.cache_root() / "native" / f"torch{torch.__version__}-{digest}"


def build_extension(name: str, sources: list[Path], build_dir: Path, extra_cflags: tuple[str, ...] = (),
                    lock_timeout_s: float = DEFAULT_TIMEOUT_S):
    """Compile (or load the cached build of) kernel sources as the extension module ``name``
    in ``build_dir``, with this module's flags (``extra_cflags`` after them: the experiments'
    -D variants and other revisions of the source). Under cascade's build lock (``build_lock``:
    torch's own lock waits forever on one a killed build left); ``BuildLockTimeout`` when another
    live build holds it past ``lock_timeout_s``."""
    from torch.utils.cpp_extension import load

    with build_lock(build_dir, lock_timeout_s):
        return load(name=name, sources=[str(p) for p in sources], build_directory=str(build_dir),
                    extra_cflags=CFLAGS + list(extra_cflags), extra_ldflags=["-fopenmp"], verbose=False)


def native_kernels():
    """The compiled extension (built and cached on first use), or None where it cannot be built
    or run here (:func:`unavailable_reason` says why)."""
    if "module" in _state:
        return _state["module"]
    module, reason = None, None
    if os.environ.get("CASCADE_NATIVE", "1") == "0":
        reason = "disabled by CASCADE_NATIVE=0"
    elif platform.machine().lower() not in ("x86_64", "amd64"):
        reason = f"the kernels are x86 (AVX2 / AVX-512); this machine is {platform.machine()}"
    else:
        try:
            module = build_extension("cascade_native", SOURCES, _build_dir())
            if module.isa() == "none":
                module, reason = None, "this CPU has neither AVX-512 nor AVX2 + FMA + F16C"
        except Exception as exc:  # no compiler, missing headers, a failed build, a lock held too long: fall back, say why
            module, reason = None, f"the extension did not build ({type(exc).__name__}: {str(exc).strip()[-300:]})"
    _state["module"], _state["reason"] = module, reason
    if reason:
        log.info("cascade native kernels unavailable: %s", reason)
    return module


def _ext():  # the built module (modules hold no reference to it, so that they deep-copy)
    return native_kernels()  # built or loaded on first use, then the cached module


def unavailable_reason() -> str | None:
    """Why :func:`native_kernels` is None (None when it is available)."""
    native_kernels()
    return _state["reason"]  # type: ignore[return-value]


def fp32_sum_bound(k: int) -> float:
    """gamma_K: the relative bound of a sequential fp32 sum of K products (times sum |x w|)."""
    u = 2.0 ** -24
    return k * u / (1 - k * u)


# ---- packing (pure) ----------------------------------------------------------------------------

def _panels(w: torch.Tensor) -> torch.Tensor:  # [N, K] -> [P, K, 32] (zero-padded columns)
    n, k = w.shape
    p = -(-n // PANEL)
    padded = torch.zeros(p * PANEL, k, dtype=w.dtype)
    padded[:n] = w
    return padded.reshape(p, PANEL, k).transpose(1, 2).contiguous()


def _unpanel(packed: torch.Tensor, n: int) -> torch.Tensor:  # [P, K, 32] -> [N, K]
    p, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(p * PANEL, k)[:n]


def pack_fp16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [P, K, 32] fp16 panels (the caller checks fp16 holds it exactly)."""
    return _panels(weight.detach().to(torch.float16))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scale [N] fp32), w ~= q * scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per (column, group of ``group`` along K): (q [N, K] in 0..15 as uint8,
    scale [N, K / group] fp32), w ~= (q - 8) * scale."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 groups of {group} need K divisible by {group}, got K = {k}")
    g = w.reshape(n, k // group, group)
    scale = (g.abs().amax(dim=2) / 7).clamp(min=torch.finfo(torch.float32).tiny)  # [N, K/G]
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7) + 8
    return q.reshape(n, k).to(torch.uint8), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [P, K, 16] bytes: byte j of a panel row holds column j (low nibble)
    and column j + 16 (high nibble)."""
    panels = _panels(q)  # [P, K, 32]
    return (panels[..., :16] | (panels[..., 16:] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: [N, K] values 0..15."""
    return _unpanel(torch.cat([packed & 0xF, packed >> 4], dim=-1), n)


def _pad(v: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, *v.shape[1:], dtype=v.dtype)
    out[: v.shape[0]] = v
    return out


# ---- modules -------------------------------------------------------------------------------------

class NativeLinear(nn.Module):
    """Inference-only ``nn.Linear`` replacement running a native kernel on [..., in] fp32 rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if native_kernels() is None:
            raise RuntimeError(f"cascade's native kernels are unavailable: {unavailable_reason()}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:  # [M, in] fp32 -> [M, out]
        raise NotImplementedError

    KIND: str  # the kernel it runs: a member of the extension's LinearKind (ops.h's LinearOp::Kind)
    PANEL_TENSORS: dict[str, str]  # LinearOp argument -> this module's tensor laid out by panels ([P, ...] / [P * 32])

    def op_fields(self) -> dict:
        """The ``LinearOp`` constructor's arguments for this layer (its kind, tensors, N, bias, group)."""
        fields = {arg: getattr(self, attr) for arg, attr in self.PANEL_TENSORS.items()}
        fields.update(kind=_ext().LinearKind.__members__[self.KIND], N=self.out_features, bias=self.bias, group=getattr(self, "group", 0))
        return fields

    def join_key(self) -> tuple:
        """Layers with equal keys can run as one op side by side (:func:`side_by_side`): the same
        kernel, input width, int4 group and bias presence."""
        return type(self), self.in_features, getattr(self, "group", 0), self.bias is None

    def op(self, **side_by_side):
        """This layer as the extension's ``LinearOp`` (the same kernel and tensors as
        ``_matmul``), for the lean forward's two-call layer; made on demand, not held, so that
        modules still deep-copy. ``side_by_side``: the op's tensors, ``N`` and ``bias`` replaced
        (:func:`side_by_side` passes several layers' joined)."""
        return _ext().LinearOp(**{**self.op_fields(), **side_by_side})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1:  # the lean forward's rows: no reshaping
            return self._matmul(x)
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).float()
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        return self._matmul(x2d).reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The weight (and bias) as a dense fp32 ``nn.Linear`` holds them (exact for fp16; the
        dequantized weights for int8 / int4)."""
        return {"weight": self.dense_weight(), **({} if self.bias is None else {"bias": self.bias.clone()})}


class NativeFP16Linear(NativeLinear):
    """fp16 weights (exactly the checkpoint's), fp32 arithmetic, row-invariant."""

    KIND, PANEL_TENSORS = "fp16", {"packed": "packed"}

    def __init__(self, linear: nn.Linear) -> None:
        bad = fp16_inexact(linear.weight)
        if bad:
            raise InexactWeightError(f"{bad} weight values are not exactly representable in fp16")
        super().__init__(linear)
        self.packed = pack_fp16(linear.weight)  # [P, K, 32] fp16

    def dense_weight(self) -> torch.Tensor:
        return _unpanel(self.packed, self.out_features).float()

    def _matmul(self, x2d):
        return _ext().linear_fp16(x2d, self.packed, self.out_features, self.bias)


class NativeInt8Linear(NativeLinear):
    """int8 weights, one scale per output channel, fp32 activations and arithmetic (a drafter's)."""

    KIND, PANEL_TENSORS = "int8", {"packed": "packed", "scale": "scale"}

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scale = quantize_int8(linear.weight)
        self.packed = _panels(q)  # [P, K, 32] int8
        self.scale = _pad(scale, self.packed.shape[0] * PANEL)  # [P * 32]

    def dense_weight(self) -> torch.Tensor:
        return _unpanel(self.packed, self.out_features).float() * self.scale[: self.out_features, None]

    def _matmul(self, x2d):
        return _ext().linear_int8(x2d, self.packed, self.scale, self.out_features, self.bias)


class NativeInt8VNNILinear(NativeLinear):
    """int8 weights (one scale per output channel) times int8 activations (quantized per row at
    each call), int32 sums: AVX-512 VNNI, four times fp32's multiply-adds per instruction, so a
    tree level or catch-up forward of several rows costs about one row's (a drafter's)."""

    KIND, PANEL_TENSORS = "int8_vnni", {"packed": "packed", "scale": "scale", "colsum": "colsum"}

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        if not _ext().has_vnni():
            raise RuntimeError("quantize='int8_vnni' needs AVX-512 VNNI (use 'int8_native')")
        q, scale = quantize_int8(linear.weight)  # [N, K]
        n, k = q.shape
        k4 = -(-k // 4) * 4
        padded = torch.zeros(n, k4, dtype=torch.int8)
        padded[:, :k] = q
        panels = _panels(padded)  # [P, K4, 32]
        p = panels.shape[0]
        self.packed = panels.reshape(p, k4 // 4, 4, PANEL).transpose(2, 3).contiguous()  # [P, K4/4, 32, 4]
        self.colsum = _pad(q.sum(1, dtype=torch.int32), p * PANEL)  # [P * 32]
        self.scale = _pad(scale, p * PANEL)  # [P * 32]
        self.in_k = k

    def dense_weight(self) -> torch.Tensor:
        p, g = self.packed.shape[:2]
        panels = self.packed.transpose(2, 3).reshape(p, g * 4, PANEL)  # [P, K4, 32]
        q = _unpanel(panels, self.out_features)[:, : self.in_k]
        return q.float() * self.scale[: self.out_features, None]

    def _matmul(self, x2d):
        return _ext().linear_int8_vnni(x2d, self.packed, self.colsum, self.scale, self.out_features, self.bias)


class NativeInt4Linear(NativeLinear):
    """int4 weights, one scale per output column and group of 64 along K (a drafter's)."""

    KIND, PANEL_TENSORS = "int4", {"packed": "packed", "scale": "scales"}

    pack = staticmethod(pack_int4)  # [N, K] 0..15 -> this kernel's byte layout ([P, K, 16])
    unpack = staticmethod(unpack_int4)

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__(linear)
        q, scale = quantize_int4(linear.weight, group)
        self.group = group
        self.packed = self.pack(q)  # uint8
        self.scales = _panels(scale)  # [P, K / G, 32]

    def dense_weight(self) -> torch.Tensor:
        q = self.unpack(self.packed, self.out_features).float() - 8  # [N, K]
        scale = _unpanel(self.scales, self.out_features)  # [N, K / G]
        return q * scale.repeat_interleave(self.group, dim=1)

    def _matmul(self, x2d):
        return _ext().linear_int4(x2d, self.packed, self.scales, self.group, self.out_features, self.bias)


def pack_int4_vnni(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K a multiple of 4) -> [P, K / 4, 64] bytes: per four consecutive k,
    byte 4c + j holds column c (low nibble) and column c + 16 (high nibble) at k = 4 g + j."""
    panels = _panels(q)  # [P, K, 32]
    p, k, _ = panels.shape
    four = panels.reshape(p, k // 4, 4, PANEL).transpose(2, 3).reshape(p, k // 4, 2, 64)  # [P, K/4, half, 16 c x 4 j]
    return (four[:, :, 0] | (four[:, :, 1] << 4)).contiguous()


def unpack_int4_vnni(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_vnni`: [N, K] values 0..15."""
    p, k4, _ = packed.shape
    four = torch.stack([packed & 0xF, packed >> 4], dim=2)  # [P, K/4, 2, 64]
    panels = four.reshape(p, k4, PANEL, 4).transpose(2, 3).reshape(p, k4 * 4, PANEL)
    return _unpanel(panels, n)


class NativeInt4VNNILinear(NativeInt4Linear):
    """The int4 weights of :class:`NativeInt4Linear` (packed for vpdpbusd: [P, K / 4, 64]) times
    int8 activations quantized per row at each call, int32 sums per group (vpdpbusd on AVX-512
    VNNI; vpmaddubsw + vpmaddwd on AVX2, the same integer sums and so the same result bit for
    bit): a drafter's token nearer its bytes' cost, where fp32 arithmetic on int4 weights is
    bound by the unpacking and the FMAs (a drafter's)."""

    KIND = "int4_vnni"
    pack = staticmethod(pack_int4_vnni)
    unpack = staticmethod(unpack_int4_vnni)

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__(linear, group)
        if _ext().int8_dot_isa() == "none":
            raise RuntimeError("quantize='int4_vnni' needs AVX-512 VNNI or AVX2 (use 'int4_native')")

    def _matmul(self, x2d):
        return _ext().linear_int4_vnni(x2d, self.packed, self.scales, self.group, self.out_features, self.bias)


def side_by_side(linears: list[NativeLinear]):
    """One ``LinearOp`` for layers that read the same input (q / k / v, gate / up): their output
    columns side by side, one kernel call instead of one per layer (and for the int8-activation
    kernels one quantization of the input). Every column is computed as in its own layer, so the
    result is bitwise the separate calls'. Their panel-laid tensors are joined into one buffer
    and each layer keeps a view of its part (no second copy of the weights). None where they
    cannot be joined: different kernels, inputs, groups or bias presence, or a layer before the
    last whose width is not a whole number of panels."""
    first = linears[0]
    if len({m.join_key() for m in linears}) != 1 or any(m.out_features % PANEL for m in linears[:-1]):
        return None
    joined: dict[str, torch.Tensor | None] = {}
    for arg, attr in first.PANEL_TENSORS.items():
        whole = torch.cat([getattr(m, attr) for m in linears])
        start = 0
        for m in linears:
            rows = getattr(m, attr).shape[0]
            setattr(m, attr, whole[start:start + rows])  # contiguous: a range of whole panels
            start += rows
        joined[arg] = whole
    joined["bias"] = None if first.bias is None else torch.cat([m.bias for m in linears])
    return first.op(N=sum(m.out_features for m in linears), **joined)


# Sizes the probe of ATen's sum order runs: shorter than a vector (its scalar path), one to a few
# vectors with and without a tail, and the widths of the models' norms.
_NORM_PROBE_WIDTHS = (5, 8, 12, 16, 24, 40, 64, 100, 896, 1536, 2048, 3584)


def aten_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama / Qwen2 RMSNorm as ATen's operations (the reference the native norm
    reproduces)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def norm_lanes() -> int:
    """The vector width (8 or 16 lanes) at which the native RMSNorm reproduces ATen's fp32 sum
    bitwise on this machine and torch build (ATen's sum kernel runs at the width of the kernels it
    dispatches to, which need not be the widest the CPU has), found once by trying both on random
    rows of several widths; 0 where neither does (the norm then runs ATen's operations)."""
    if "norm_lanes" not in _state:
        ext, lanes = _ext(), 0
        if ext is not None:
            gen = torch.Generator().manual_seed(0)
            probes = [(torch.randn(3, e, generator=gen) * 3, torch.randn(e, generator=gen)) for e in _NORM_PROBE_WIDTHS]
            with torch.inference_mode():
                lanes = next((w for w in (8, 16) if all(torch.equal(ext.rms_norm(x, wt, 1e-6, w), aten_rms_norm(x, wt, 1e-6))
                                                        for x, wt in probes)), 0)
        if lanes == 0:
            log.info("the native RMSNorm does not reproduce ATen's sum here: the norms run ATen's operations")
        _state["norm_lanes"] = lanes
    return _state["norm_lanes"]  # type: ignore[return-value]


ATTENTION = "cascade_native"  # the name the attention function is registered under in transformers


def native_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """A transformers attention function (``AttentionInterface``) over the native kernel:
    query [B, H, n, D], key / value [B, Hkv, L, D] (the cache, grouped heads not repeated),
    attention_mask None (causal: query i sees keys up to L - n + i) or a 4D [B, 1, n, L] mask
    (additive float 0 / -inf, or boolean: True = visible). Returns ([B, n, H, D], None).
    Row-invariant: a query's output is bitwise the same whatever the other queries of the call."""
    if dropout:
        raise ValueError("native attention is for inference (dropout 0)")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"native attention does not implement {unsupported}")
    mask = attention_mask
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, float("-inf"))
        mask = mask.float()
    scaling = module.scaling if scaling is None else scaling
    out = attention_kernel(query.float(), key.float(), value.float(), mask, float(scaling))
    return out.to(query.dtype), None


def attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """The native attention over the cache: fp32 query [B, H, n, D], key / value [B, Hkv, L, D],
    mask None (causal) or fp32 [B or 1, 1, n, L] additive -> [B, n, H, D]. (One name for both
    callers, transformers' attention function and the lean forward, so a profiler can time it.)"""
    return _ext().attention(query, key, value, mask, scaling)


def use_native_attention(model: nn.Module) -> None:
    """Register :func:`native_attention` with transformers and make ``model`` use it."""
    from transformers import AttentionInterface

    if native_kernels() is None:
        raise RuntimeError(f"cascade's native kernels are unavailable: {unavailable_reason()}")
    AttentionInterface.register(ATTENTION, native_attention)
    model.config._attn_implementation = ATTENTION


def swap_linears(model: nn.Module, make) -> tuple[int, list[str]]:
    """Swap every ``nn.Linear`` of an fp32 CPU model (in place) for ``make(linear)``; a layer
    ``make`` refuses (ValueError: e.g. fp16 cannot hold its weights, K not divisible by the
    int4 group) keeps its exact fp32 linear. Returns (swapped count, names kept)."""
    swapped, kept = 0, []
    for pname, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                try:
                    setattr(parent, name, make(child))
                    swapped += 1
                except ValueError:
                    kept.append(f"{pname}.{name}" if pname else name)
    return swapped, kept
