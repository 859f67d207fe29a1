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


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory: a sum over ``gib`` GiB of fp32 (far
    larger than any cache), on the threads torch is set to use (forward_cost's roofline)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    return x.numel() * 4 / median_s(lambda: x.sum(), repeats)
