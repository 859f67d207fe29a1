"""Do copies of one drafter model run at one speed? The benchmarks load a drafter per method.

Each method of a benchmark builds its own drafter, and a ``QuantizedLMDrafter`` given a model
name loads and quantizes its own copy of the weights. Two methods that draft alike then read
different copies, in different memory. This loads ``--copies`` copies the way the methods do,
gives each a cache holding ``--context`` positions, and times one-token forwards of each copy in
turn (rounds interleaved, so a host's drift falls on every copy alike): per copy the median and
mean ms, and the ratio of each median to the fastest.

    python experiments/drafter_copies.py [--model qwen2.5-coder-0.5b] [--quantize auto] [--copies 4] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from cascade.drafters import QuantizedLMDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-round", type=int, default=8, help="one-token forwards per copy per round")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    models = [QuantizedLMDrafter(args.model, quantize=args.quantize).model for _ in range(args.copies)]
    caches = []
    for lm in models:
        cache = lm.new_cache()
        lm.forward(list(range(100, 100 + args.context)), cache)
        caches.append(cache)
    ms: list[list[float]] = [[] for _ in models]
    for _ in range(args.rounds):
        for lm, cache, out in zip(models, caches, ms):
            t0 = time.perf_counter()
            for _ in range(args.per_round):
                lm.forward([5], cache)
            out.append((time.perf_counter() - t0) / args.per_round * 1000)
            lm.crop(cache, args.context)
    medians = [statistics.median(x) for x in ms]
    print(f"{args.model} on {models[0].name}, {args.copies} copies, {args.rounds} interleaved rounds of "
          f"{args.per_round} one-token forwards at {args.context} cached positions, {args.threads} threads")
    for i, (x, med) in enumerate(zip(ms, medians)):
        print(f"copy {i}: median {med:.2f} ms, mean {statistics.mean(x):.2f} ms, {med / min(medians):.3f}x the fastest")


if __name__ == "__main__":
    main()
