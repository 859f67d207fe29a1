"""Cost of one target forward over k new tokens (on a 200-token cache), relative to k = 1.

This is the slack speculative verification lives on. Compares backends side by side in one
process: bf16, fp32 (transformers' default kernels) and fp32 with oneDNN linears.

    python experiments/forward_cost.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cascade import load_model


def forward_times(lm, ks, repeats: int) -> dict[int, float]:
    cache = lm.new_cache()
    lm.forward(list(range(100, 300)), cache, keep_last=1)
    base = lm.cache_len(cache)
    out = {}
    for k in ks:
        samples = []
        for _ in range(repeats + 1):  # first call is a warm-up
            t0 = time.perf_counter()
            lm.forward(list(range(1, k + 1)), cache)
            samples.append(time.perf_counter() - t0)
            lm.crop(cache, base)
        out[k] = statistics.median(samples[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    backends = {"bf16": dict(dtype="bfloat16"), "fp32": dict(dtype="float32"), "fp32+oneDNN": dict(dtype="float32", onednn=True)}
    print(f"{args.model}, {args.threads} threads, median of {args.repeats}; ms per forward (ratio to k=1)")
    print(f"{'backend':12s} " + " ".join(f"{'k=' + str(k):>14s}" for k in ks))
    for name, kwargs in backends.items():
        lm = load_model(args.model, **kwargs)
        times = forward_times(lm, ks, args.repeats)
        print(f"{name:12s} " + " ".join(f"{1000 * times[k]:7.0f} ({times[k] / times[1]:4.2f})" for k in ks))
        del lm


if __name__ == "__main__":
    main()
