"""Timing helpers shared by the micro-benchmarks in ``experiments/`` (kernels, bandwidth): a
median timer and the memory-read probe the roofline uses. Decoding itself is timed inside
``cascade.decode`` (per step, with device synchronisation), not here."""

from __future__ import annotations

import statistics
import time

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
    """The memory-read probe: a sum over ``gib`` GiB of fp32 (far larger than any cache), on the
    threads torch is set to use. ``read()`` runs it once; ``nbytes`` is what one read streams."""

    def __init__(self, gib: float = 1.0) -> None:
        self.x = torch.ones(int(gib * (1 << 30)) // 4)
        self.nbytes = self.x.numel() * 4

    def read(self) -> None:
        self.x.sum()


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory (the median of ``repeats`` probe reads)."""
    probe = ReadProbe(gib)
    return probe.nbytes / median_s(probe.read, repeats)
