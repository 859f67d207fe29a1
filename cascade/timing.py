"""Timing helpers shared by the micro-benchmarks in ``experiments/`` (kernels, bandwidth): a
median timer and the memory-read probe the roofline uses. Decoding itself is timed inside
``cascade.decode`` (per step, with device synchronisation), not here."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


def median_s(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class ReadProbe:
    """The memory-read probes, over ``gib`` GiB (far larger than any cache), on the threads torch
    is set to use: ``read()`` a torch sum over fp32 (what torch's own reductions reach), and
    ``read_native()`` cascade's streaming read at the kernels' prefetch distance
    (``csrc/bandwidth.cpp``; None where the extension is unavailable), whose fastest pass is the
    bound a kernel's "% of bound" divides by. ``nbytes`` is what one read streams."""

    def __init__(self, gib: float = 1.0) -> None:
        self.x = torch.ones(int(gib * (1 << 30)) // 4)
        self.nbytes = self.x.numel() * 4
        self._bytes = self.x.view(torch.uint8)

    def read(self) -> None:
        self.x.sum()

    def time_reads(self) -> tuple[float, list[float]]:
        """Seconds of one torch-sum read, then of one native streaming read per prefetch target
        (into L1, into L2; empty without the extension): one sample of each probe, back to back."""
        t0 = time.perf_counter()
        self.read()
        sum_s, native = time.perf_counter() - t0, []
        for into_l2 in (False, True):
            t1 = time.perf_counter()
            if not self.read_native(into_l2):
                break
            native.append(time.perf_counter() - t1)
        return sum_s, native

    def read_native(self, into_l2: bool = False) -> bool:
        """One streaming read of the buffer, prefetching into L1 or L2; False where the native
        extension is unavailable."""
        from cascade.models.backends.native import native_kernels

        ext = native_kernels()
        if ext is None:
            return False
        ext.stream_read(self._bytes, into_l2)
        return True


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidth in bytes/s: ``bound``, the fastest of the native streaming reads (prefetching
    into L1 or L2; None without the extension), and ``torch_sum``, the median torch sum beside it."""

    bound: float | None
    torch_sum: float

    @property
    def best(self) -> float:
        """The bound where measured, else torch's sum (a rate, not a bound)."""
        return self.bound if self.bound is not None else self.torch_sum


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> Bandwidth:
    """This machine's read bandwidth: the fastest of ``repeats`` native streaming reads and the
    median of as many torch sums, interleaved."""
    probe = ReadProbe(gib)
    native, summed = [], []
    probe.read()  # warm-up (pages touched)
    for _ in range(repeats):
        sum_s, native_s = probe.time_reads()
        summed.append(sum_s)
        native += native_s
    return Bandwidth(probe.nbytes / min(native) if native else None, probe.nbytes / statistics.median(summed))
