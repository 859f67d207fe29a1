"""What a forward costs: measured on this machine, or predicted from a named device's roofline.

DyTC prices a tree through a :class:`CostModel` (seconds of a target forward over n inputs, of an
LM drafter's forward over w nodes, of a forward-free proposal; each with its uncertainty), of
two kinds:

:class:`MeasuredCosts`
    the timings of this run, made robust: per input count a window of the latest raw samples
    whose **median** is the estimate (up to half the window slowed by a busy host moves it
    nothing), the medians made monotone (isotonic regression) and convex (the lower hull), and
    the window's spread kept as each estimate's standard error (1.4826 MAD / sqrt(samples)).
:class:`RooflineCosts`
    a named :class:`Device` (bandwidth, peak arithmetic, per-forward and per-layer overhead; each
    entry states its source) against each model's :class:`ForwardShape` (the bytes its linear
    layers hold as loaded, 2 FLOPs per weight per input, its KV cache's bytes per position):
    ``t(n) = overhead + max(bytes / bandwidth, flops(n) / peak)``. Deterministic, so a run priced
    by it builds the same trees from the same tokens, and its clock (:class:`VirtualClock`) is a
    **prediction** for that device, never a measurement.

A :class:`VirtualClock` advances by the roofline time of every model forward it is told of
(``cascade.models.lm.observe_forwards``) and by the device's per-step and per-proposal host
costs; ``cascade.generate(clock=...)`` then records predicted times in place of wall times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from cascade.estimators import convex_minorant, isotonic

# ---- devices ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A device's roofline. ``bandwidth`` and ``peak_flops`` are what a forward can reach (for
    a published GPU: the datasheet figure times an achievable fraction stated in ``source``);
    overheads are per forward call and per decoder layer of it (kernel launches, framework);
    ``host_step_s`` the decode loop's own work per step (acceptance, bookkeeping) and
    ``lookup_s`` one forward-free proposal (n-gram, Token Recycling) on the host. ``overlap``: the
    forward's weight reads and arithmetic overlap (its time the larger of the two) or add (read
    off a measured curve that rises from the first extra input: the sum)."""

    name: str
    bandwidth: float  # bytes / s a forward streams weights at
    peak_flops: float  # FLOP / s of the arithmetic the backend runs (fp32 on CPUs here, bf16 tensor cores on GPUs)
    forward_overhead_s: float
    layer_overhead_s: float
    host_step_s: float
    lookup_s: float
    kv_bytes: int  # bytes per cached key / value element (fp32 caches on the CPU backends, bf16 on GPUs)
    source: str
    measured: bool  # True: constants measured on such a machine here; False: from public specifications
    overlap: bool = True  # True: t = max(reads, arithmetic); False: t = reads + arithmetic


def _datasheet_gpu(name: str, bandwidth: float, peak_flops: float, forward_overhead_s: float, layer_overhead_s: float,
                   datasheet: str) -> Device:
    """A GPU from its datasheet: 80% of its bandwidth and 60% of its dense BF16 peak assumed
    achievable, overheads assumed for CUDA-graph decoding, bf16 caches."""
    return Device(name, bandwidth=0.8 * bandwidth, peak_flops=0.6 * peak_flops, forward_overhead_s=forward_overhead_s,
                  layer_overhead_s=layer_overhead_s, host_step_s=1.0e-4, lookup_s=2e-5, kv_bytes=2,
                  source=f"{datasheet}; assumed achievable: 80% of the bandwidth, 60% of the peak; overheads assumed for "
                         f"CUDA-graph decoding (about {layer_overhead_s * 1e6:.0f} us per layer)", measured=False)


def _measured_cpu(name: str, bandwidth: float, peak_flops: float, forward_overhead_s: float, source: str,
                  overlap: bool = True) -> Device:
    """A CPU measured here (the 1.5B's native forward): no per-layer overhead beyond the forward's,
    the loop's other work ~1 ms a step and a forward-free proposal 0.15 ms (measured on the Zen 5
    EPYC, experiments/loop_profile.py; assumed on the others), fp32 caches."""
    return Device(name, bandwidth=bandwidth, peak_flops=peak_flops, forward_overhead_s=forward_overhead_s,
                  layer_overhead_s=0.0, host_step_s=1.0e-3, lookup_s=1.5e-4, kv_bytes=4, source=source, measured=True,
                  overlap=overlap)


DEVICES: dict[str, Device] = {
    "zen5_epyc": _measured_cpu(
        "AMD EPYC Zen 5 (family 26 model 2), 2 cores", bandwidth=44.1e9, peak_flops=445e9, forward_overhead_s=2.1e-3,
        source="measured here: results/kernels/forward_cost_1.5b_zen5.log (commit ca9ab6c): the 1.5B's native "
               "linears stream 3.09 GB in 70 ms at k=1 (44.1 GB/s) and do 16 x 3.09 GFLOP in 111 ms at k=16 "
               "(445 GFLOP/s); the forward minus its linears 2.1 ms at k=1; the loop's other work ~1 ms "
               "(experiments/loop_profile.py); a forward-free proposal assumed 0.15 ms"),
    "zen4_epyc": _measured_cpu(
        "AMD EPYC Zen 4 (family 25 model 17), 2 cores", bandwidth=31.5e9, peak_flops=189e9, forward_overhead_s=5.0e-3,
        source="measured here: results/kernels/forward_cost_zen4.log (commit c87cde7): the 1.5B's native linears "
               "take 98, 102, 99, 112, 134, 262 ms at k=1, 2, 4, 6, 8, 16: flat to k=4, then arithmetic-bound "
               "(reads and arithmetic overlap); 3.09 GB in 98 ms (31.5 GB/s; the read probe 32.1 GB/s) and "
               "16 x 3.09 GFLOP in 262 ms (189 GFLOP/s); the forward minus its linears 5 ms at k=1 (103 - 98); "
               "the loop's other work and a forward-free proposal assumed as on zen5_epyc"),
    "zen3_epyc": _measured_cpu(
        "AMD EPYC Zen 3 (family 25 model 1), 2 cores, AVX2 only", bandwidth=29.4e9, peak_flops=183e9,
        forward_overhead_s=1.0e-3,
        source="measured here: results/kernels/forward_cost_gguf_zen3.log (commit e3f296a): the 1.5B's native "
               "linears take 122 ms at k=1 and 375 ms at k=16 and rise from k=2 on (118, 173, 189, 258 ms at "
               "k=2, 4, 6, 8): reads and arithmetic add, they do not overlap; the line through k=1 and k=16 is "
               "16.9 ms per input (3.09 GFLOP: 183 GFLOP/s) plus 105 ms (3.09 GB: 29.4 GB/s; the read probe "
               "30.0 GB/s); the forward minus its linears measured 0.1 ms at k=1, within the timings' noise, "
               "taken as 1 ms; the loop's other work and a forward-free proposal assumed as on zen5_epyc",
        overlap=False),
    "a100": _datasheet_gpu("NVIDIA A100 80GB SXM", 2.039e12, 312e12, forward_overhead_s=30e-6, layer_overhead_s=6e-6,
                           datasheet="NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s dense BF16"),
    "h100": _datasheet_gpu("NVIDIA H100 80GB SXM5", 3.35e12, 989e12, forward_overhead_s=25e-6, layer_overhead_s=5e-6,
                           datasheet="NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOP/s dense BF16"),
}


def device_named(name: str | Device) -> Device:
    if isinstance(name, Device):
        return name
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}: one of {', '.join(sorted(DEVICES))} (cascade/costs.py DEVICES)")
    return DEVICES[name]


# ---- a model's forward, as a roofline sees it --------------------------------------------------


@dataclass(frozen=True)
class ForwardShape:
    weight_bytes: float  # what one forward streams: every linear layer's tensors as loaded (LM head included)
    weight_count: float  # multiply-adds per input: the linear layers' weights
    layers: int
    kv_values_per_position: int  # keys + values cached per position, all layers
    attention_flops_per_position: float  # per input, per cached position (QK^T and PV, all heads and layers)

    @classmethod
    def of(cls, lm) -> "ForwardShape":
        """The shape of ``lm`` (a ``CausalLM``) as loaded: its linears' bytes in their own format."""
        cfg = lm.model.config
        layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        nbytes, count = linear_bytes(lm.model)
        return cls(nbytes, count, layers, 2 * layers * kv_heads * head_dim, 4.0 * layers * heads * head_dim)

    def parts(self, device: Device, inputs: int, context: int) -> tuple[float, float, float]:
        """(overheads, reads, arithmetic) of one forward of ``inputs`` inputs over ``context``
        cached positions on ``device``, in seconds, before they are combined."""
        kv = self.kv_values_per_position * (context + inputs) * device.kv_bytes
        flops = inputs * (2.0 * self.weight_count + self.attention_flops_per_position * (context + inputs))
        overheads = device.forward_overhead_s + device.layer_overhead_s * self.layers
        return overheads, (self.weight_bytes + kv) / device.bandwidth, flops / device.peak_flops

    def seconds(self, device: Device, inputs: int, context: int) -> float:
        """Roofline time of one forward of ``inputs`` inputs over ``context`` cached positions."""
        overheads, reads, arithmetic = self.parts(device, inputs, context)
        return overheads + float(combine(device, reads, arithmetic))


def combine(device: Device, reads, arithmetic):
    """A forward's work from its reads and arithmetic (seconds, or arrays of them): overlapped
    (the larger) or added."""
    return np.maximum(reads, arithmetic) if device.overlap else reads + arithmetic


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or any of cascade's native / quantized linears (a module with in / out features)."""
    return hasattr(module, "in_features") and hasattr(module, "out_features")


def linear_bytes(model: nn.Module) -> tuple[float, float]:
    """(bytes, weights) of every linear layer of ``model``: ``nn.Linear`` and cascade's native and
    quantized linears (any module with ``in_features`` / ``out_features``), counting the tensors each
    holds as loaded (packed weights, scales, biases) once (a tied LM head shares its embedding)."""
    seen: set[int] = set()
    nbytes = count = 0.0
    for m in model.modules():
        if not is_linear(m):
            continue
        count += float(m.in_features) * float(m.out_features)
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        tensors += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            if id(t) not in seen:  # a tied LM head is its embedding's Parameter: counted once
                seen.add(id(t))
                nbytes += t.numel() * t.element_size()
    return nbytes, count


# ---- the cost model a policy asks ---------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    """Seconds, with the standard error of the estimate (0: a model's prediction, no sampling)."""

    seconds: float
    sd: float = 0.0


class CostModel(Protocol):
    kind: str  # "measured" or "roofline:<device>"
    predicts: bool  # True: prices are a device's predictions (a step's cost is priced, not measured)

    def verify_sizes(self) -> int: ...  # how many input counts the verification prices are made of

    def set_context(self, positions: int) -> None: ...  # the cached positions the next forwards run over

    def verify(self, inputs: float) -> Price | None: ...  # the target over ``inputs`` inputs (None: unknown yet)

    def forward(self, drafter: str, width: int) -> Price | None: ...  # an LM drafter over ``width`` nodes

    def lookup(self, drafter: str) -> Price | None: ...  # one forward-free proposal

    def observe_verify(self, inputs: int, seconds: float) -> None: ...

    def observe_forward(self, drafter: str, width: int, seconds: float) -> None: ...

    def observe_lookup(self, drafter: str, seconds: float) -> None: ...

    def snapshot(self) -> dict: ...


class RobustCurve:
    """t(n) from raw samples: per n the median of the last ``per_size`` samples, monotone and
    convex in n; sizes not measured within the last ``window`` updates drop out (a host's speed
    drifts; a size never visited again must not hold the curve)."""

    def __init__(self, per_size: int = 16, window: int = 48) -> None:
        if per_size < 1 or window < 1:
            raise ValueError(f"per_size and window must be >= 1, got {per_size}, {window}")
        self.per_size, self.window = per_size, window
        self.samples: dict[int, deque[float]] = {}
        self.last: dict[int, int] = {}
        self.updates = 0
        self._points: list[tuple[int, float, float]] | None = None  # the fit, until the next sample

    def update(self, n: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return  # a broken timing is not a measurement
        self._points = None
        self.updates += 1
        self.samples.setdefault(n, deque(maxlen=self.per_size)).append(seconds)
        self.last[n] = self.updates

    def current(self) -> list[int]:
        return sorted(n for n, at in self.last.items() if self.updates - at < self.window)

    @property
    def sizes(self) -> int:
        return len(self.current())

    def _stats(self, n: int) -> tuple[float, float]:
        """(median, standard error of it) of size n's samples; one sample: a 10% error."""
        xs = list(self.samples[n])
        med = statistics.median(xs)
        if len(xs) < 3:
            return med, 0.1 * med
        mad = statistics.median(abs(x - med) for x in xs)
        return med, max(1.4826 * mad, 0.01 * med) * 1.2533 / math.sqrt(len(xs))  # the median's s.e. (normal noise)

    def points(self) -> list[tuple[int, float, float]]:
        """(n, seconds, standard error) at every current n, seconds monotone and convex in n (fitted
        once per sample: the policy prices every candidate node from it)."""
        if self._points is None:
            ns = self.current()
            stats = [self._stats(n) for n in ns]
            monotone = isotonic([m for m, _ in stats], [len(self.samples[n]) for n in ns])
            self._points = [(n, t, se) for n, t, (_, se) in zip(ns, convex_minorant(ns, monotone), stats)]
        return self._points

    def predict(self, n: float) -> Price | None:
        pts = self.points()
        if not pts:
            return None
        if len(pts) == 1:
            n0, t0, s0 = pts[0]
            return Price(t0 * max(n, n0) / n0, s0 * max(n, n0) / n0)  # one size: flat below, proportional above
        if n <= pts[0][0]:
            return Price(pts[0][1], pts[0][2])
        for (n0, t0, s0), (n1, t1, s1) in zip(pts, pts[1:]):
            if n <= n1:
                f = (n - n0) / (n1 - n0)
                return Price(t0 + (t1 - t0) * f, math.hypot((1 - f) * s0, f * s1))
        (n0, t0, s0), (n1, t1, s1) = pts[-2], pts[-1]
        f = (n - n1) / (n1 - n0)
        return Price(t1 + (t1 - t0) * f, math.hypot((1 + f) * s1, f * s0))

    def snapshot(self) -> dict[int, float]:
        return {n: round(t, 6) for n, t, _ in self.points()}


class MeasuredCosts:
    """Costs from this run's own timings (:class:`RobustCurve` per forward, medians per proposal)."""

    kind, predicts = "measured", False

    def __init__(self, per_size: int = 16, window: int = 48) -> None:
        self.verify_curve = RobustCurve(per_size, window)
        self.forward_curves: dict[str, RobustCurve] = {}
        self.lookups: dict[str, deque[float]] = {}
        self._per_size, self._window = per_size, window

    def verify_sizes(self) -> int:
        return self.verify_curve.sizes

    def set_context(self, positions: int) -> None:
        pass  # measured at whatever context the run is at

    def verify(self, inputs: float) -> Price | None:
        return self.verify_curve.predict(inputs)

    def forward(self, drafter: str, width: int) -> Price | None:
        curve = self.forward_curves.get(drafter)
        return None if curve is None or not curve.sizes else curve.predict(width)

    def lookup(self, drafter: str) -> Price | None:
        xs = self.lookups.get(drafter)
        return None if not xs else Price(statistics.median(xs))

    def observe_verify(self, inputs: int, seconds: float) -> None:
        self.verify_curve.update(inputs, seconds)

    def observe_forward(self, drafter: str, width: int, seconds: float) -> None:
        self.forward_curves.setdefault(drafter, RobustCurve(self._per_size, self._window)).update(width, seconds)

    def observe_lookup(self, drafter: str, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.lookups.setdefault(drafter, deque(maxlen=self._per_size)).append(seconds)

    def snapshot(self) -> dict:
        return {
            "drafter_cost_s": {k: round(statistics.median(v), 6) for k, v in self.lookups.items() if v},
            "forward_curve_s": {k: c.snapshot() for k, c in self.forward_curves.items() if c.sizes},
            "verify_curve_s": self.verify_curve.snapshot() or None,
        }


class RooflineCosts:
    """Costs predicted for ``device`` from the models' shapes (no sampling error; observations
    are ignored: what this machine measures says nothing of that device)."""

    predicts = True

    def __init__(self, device: Device | str, target: ForwardShape, drafters: dict[str, ForwardShape]) -> None:
        self.device, self.target, self.drafters = device_named(device), target, drafters
        self.kind = f"roofline:{self.device.name}"
        self.context = 0  # cached positions the next forwards run over (set by the policy per step)

    def verify_sizes(self) -> int:
        return 2**31  # every size: a model, not samples

    def set_context(self, positions: int) -> None:
        self.context = positions

    def verify(self, inputs: float) -> Price:
        lo = max(int(math.floor(inputs)), 1)
        t0 = self.target.seconds(self.device, lo, self.context)
        t1 = self.target.seconds(self.device, lo + 1, self.context)
        return Price(t0 + (t1 - t0) * (inputs - lo))

    def forward(self, drafter: str, width: int) -> Price | None:
        shape = self.drafters.get(drafter)
        return None if shape is None else Price(shape.seconds(self.device, width, self.context))

    def lookup(self, drafter: str) -> Price:
        return Price(self.device.lookup_s)

    def observe_verify(self, inputs: int, seconds: float) -> None:
        pass

    def observe_forward(self, drafter: str, width: int, seconds: float) -> None:
        pass

    def observe_lookup(self, drafter: str, seconds: float) -> None:
        pass

    def snapshot(self) -> dict:
        return {"verify_curve_s": {n: round(self.verify(n).seconds, 7) for n in (1, 2, 4, 8, 16, 32, 64)}}


# ---- the virtual clock -------------------------------------------------------------------------


class VirtualClock:
    """Predicted seconds on ``device``: each model forward it is told of advances it by that
    model's roofline time; each decode step by the device's host work. Models are priced by
    their :class:`ForwardShape` (computed once per model)."""

    def __init__(self, device: Device | str, shapes: list[tuple[object, ForwardShape]] = ()) -> None:
        """``shapes``: (model or head, the :class:`ForwardShape` to price it by in place of its
        own) pairs (a test's controlled timings)."""
        self.device = device_named(device)
        self.seconds = 0.0
        self._shapes: dict[int, ForwardShape] = {id(owner): shape for owner, shape in shapes}

    @property
    def label(self) -> str:
        return f"predicted:{self.device.name}"

    def now(self) -> float:
        return self.seconds

    def forward(self, owner, name: str, shape, inputs: int, context: int) -> None:
        """``owner`` (a model or a draft head; ``shape()`` its :class:`ForwardShape`) ran a forward
        of ``inputs`` inputs over ``context`` cached positions (``cascade.models.lm.observe_forwards``)."""
        key = id(owner)
        if key not in self._shapes:
            self._shapes[key] = shape()
        self.seconds += self._shapes[key].seconds(self.device, inputs, context)

    def host(self, seconds: float) -> None:
        self.seconds += seconds


# ---- the clock of the decode in progress -----------------------------------------------------

_RUNNING: ContextVar[VirtualClock | None] = ContextVar("cascade_virtual_clock", default=None)


@contextmanager
def running_on(clock: VirtualClock | None):
    """Within: :func:`decode_clock` reads ``clock`` (None: the wall clock)."""
    token = _RUNNING.set(clock)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def decode_clock() -> float:
    """Seconds on the clock the decode in progress runs on: a virtual clock's predictions inside
    ``cascade.generate(clock=...)``, else the wall clock. What every timing inside the loop reads
    (drafter calls, cascade levels), so that a virtual run never mixes in a measured second."""
    clock = _RUNNING.get()
    return time.perf_counter() if clock is None else clock.now()


def charge_lookup() -> None:
    """A forward-free proposal ran on the host: the running virtual clock charges its device's
    ``lookup_s`` (the wall clock needs nothing: it measured it)."""
    clock = _RUNNING.get()
    if clock is not None:
        clock.host(clock.device.lookup_s)
