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

import json
import time
from pathlib import Path

import torch
from torch import nn

from cascade.models.exact_fp16 import InexactWeightError, fp16_inexact
from cascade.models.native import NativeFP16Linear, native_kernels, swap_linears


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


# ---- per (shape, rows) dispatch --------------------------------------------------------------
# Which kernel is fastest depends on the weight's shape and on how many rows (tokens) a forward
# multiplies: FBGEMM's fp16-weight GEMM and cascade's native fp16 kernel stream half the bytes
# (decoding, verification), oneDNN's fp32 inner product can win on wide inputs (prefill) and some
# shapes. (Mixing kernels by row count gives up the native kernel's row invariance: for bitwise
# verification use ``backend="native"`` alone.) A short calibration on
# this CPU times every candidate for every distinct linear shape at ROW_BUCKETS rows; a forward
# of r rows then runs the kernel that was fastest at the first bucket >= r (the last beyond it).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
KERNELS = {"fp16w": FP16WeightLinear, "onednn": OneDNNLinear, "native": NativeFP16Linear}
FP16_KERNELS = ("fp16w", "native")  # kernels that hold the weight in fp16 (offered only where fp16 holds it exactly)


def row_bucket(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket a forward of ``rows`` rows falls in."""
    for i, b in enumerate(ROW_BUCKETS):
        if rows <= b:
            return i
    return len(ROW_BUCKETS) - 1


def available_kernels() -> list[str]:
    """The candidate kernels this torch build / CPU can run."""
    return [k for k, ok in (("fp16w", fbgemm_available()), ("onednn", onednn_available()),
                            ("native", native_kernels() is not None)) if ok]


def shape_key(linear: nn.Linear) -> str:
    return f"{linear.in_features}x{linear.out_features}{'+bias' if linear.bias is not None else ''}"


def _time_ms(module: nn.Module, x: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        module(x)  # warm-up (first-call packing, page faults)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def calibrate_shape(in_features: int, out_features: int, bias: bool, kernels: list[str], repeats: int = 5,
                    seed: int = 0) -> dict[str, list[float]]:
    """Milliseconds per call of each kernel at each of ROW_BUCKETS rows, on a random weight of the
    shape (values fp16 holds exactly, so every candidate can take it)."""
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.copy_((torch.randn(out_features, in_features, generator=gen) * 0.02).half().float())
        if bias:
            lin.bias.copy_(torch.randn(out_features, generator=gen).half().float())
    out = {}
    for name in kernels:
        module = KERNELS[name](lin)
        out[name] = [round(_time_ms(module, torch.randn(r, in_features, generator=gen), repeats), 4) for r in ROW_BUCKETS]
        del module
    return out


class KernelPlan:
    """Per linear shape: the measured milliseconds of each kernel per row bucket, and the chosen
    kernel per bucket. Stored as JSON (one file per CPU model, thread count and torch version:
    what the timings depend on; shared by every model with the same shapes)."""

    def __init__(self, path, entries: dict | None = None) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict] = dict(entries or {})

    @classmethod
    def load(cls, path) -> "KernelPlan":
        path = Path(path)
        if not path.is_file():
            return cls(path)
        data = json.loads(path.read_text())
        if data.get("buckets") != list(ROW_BUCKETS):
            return cls(path)  # measured at other row counts: calibrate again
        return cls(path, data["shapes"])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"buckets": list(ROW_BUCKETS), "shapes": self.entries}, indent=1))
        tmp.replace(self.path)

    def choice(self, key: str, allowed: list[str]) -> list[str]:
        """The fastest allowed kernel per row bucket for shape ``key`` (calibrated)."""
        ms = self.entries[key]["ms"]
        return [min((k for k in allowed if k in ms), key=lambda k: ms[k][i]) for i in range(len(ROW_BUCKETS))]

    def calibrate(self, linears: list[nn.Linear], kernels: list[str], repeats: int = 5, log=None) -> int:
        """Time every shape of ``linears`` not yet in the plan (with every kernel of ``kernels``
        not yet timed for it); returns how many shapes were timed."""
        todo = {}
        for lin in linears:
            key = shape_key(lin)
            missing = [k for k in kernels if k not in self.entries.get(key, {}).get("ms", {})]
            if missing:
                todo[key] = (lin, missing)
        for key, (lin, missing) in todo.items():
            ms = calibrate_shape(lin.in_features, lin.out_features, lin.bias is not None, missing, repeats)
            self.entries.setdefault(key, {"ms": {}})["ms"].update(ms)
            if log is not None:
                log(key, self.entries[key]["ms"])
        if todo:
            self.save()
        return len(todo)


class DispatchLinear(nn.Module):
    """Inference-only ``nn.Linear`` that runs each forward through the kernel its plan chose for
    the forward's row count. Only the kernels the plan uses are built (each holds the weight)."""

    def __init__(self, linear: nn.Linear, choice: list[str]) -> None:
        super().__init__()
        if len(choice) != len(ROW_BUCKETS):
            raise ValueError(f"a choice per row bucket ({len(ROW_BUCKETS)}) is needed, got {choice}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.choice = list(choice)
        self.kernels = nn.ModuleDict({k: KERNELS[k](linear) for k in dict.fromkeys(choice)})

    def dense_state(self) -> dict[str, torch.Tensor]:
        return next(iter(self.kernels.values())).dense_state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.kernels[self.choice[row_bucket(x.numel() // self.in_features)]](x)


def use_dispatch_linears(model: nn.Module, plan: KernelPlan, kernels: list[str] | None = None,
                         repeats: int = 5, log=None) -> dict[str, list[str]]:
    """Swap every ``nn.Linear`` of an fp32 CPU model (in place) for :class:`DispatchLinear` with
    the plan's choice per row bucket, calibrating shapes the plan lacks. A layer whose weights
    fp16 cannot hold exactly is not offered the fp16 kernels. Returns shape -> choice per bucket."""
    kernels = available_kernels() if kernels is None else kernels
    if not kernels:
        raise RuntimeError("none of FBGEMM's fp16 GEMM, oneDNN or cascade's native kernels is available here")
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children()) if type(child) is nn.Linear]
    plan.calibrate([c for _, _, c in linears], kernels, repeats, log)
    chosen: dict[str, list[str]] = {}
    for parent, name, child in linears:
        allowed = [k for k in kernels if k not in FP16_KERNELS or fp16_inexact(child.weight) == 0]
        if not allowed:  # only fp16 kernels were offered and fp16 cannot hold this layer: keep it exact
            continue
        key = shape_key(child)
        choice = plan.choice(key, allowed)
        chosen[key if allowed == kernels else f"{key} (fp32 only)"] = choice
        setattr(parent, name, DispatchLinear(child, choice))
    return chosen
