"""What the direct forward saves over transformers' own: ms per forward and per sampled generation.

The direct forward (``cascade/models/backends/direct.py``) and transformers' forward run the same
arithmetic; this times both, interleaved in one process (rounds alternate, medians), on

- the deep losslessness suite's float64 tiny models (``tests/test_lossless_deep.py``: 3 layers,
  vocabulary 5): forwards of 1 and 4 tokens, and generations of 6 tokens sampled at T = 1 with a
  small-LM chain (k 5), a vertical cascade and a dynamic tree (the suite's work per cell);
- optionally a real model (``--model``, e.g. smollm2-135m), forwards of 1 and 4 tokens.

Both paths' generations are checked equal token for token.

    python experiments/direct_forward.py [--generations 100] [--rounds 5] [--model smollm2-135m --dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from cascade import generate, load_model
from cascade.models.backends.direct import DirectDecoder
from cascade.types import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def set_path(lms, direct: bool) -> None:
    for lm in lms:
        lm.use_forward(DirectDecoder(lm.model) if direct else None)


def forward_ms(lm, k: int, repeats: int = 50) -> float:
    cache = lm.new_cache()
    lm.forward([t % lm.vocab_size for t in range(8)], cache)
    past = lm.cache_len(cache)
    tokens = [t % lm.vocab_size for t in range(1, k + 1)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lm.forward(tokens, cache)
        times.append(time.perf_counter() - t0)
        lm.crop(cache, past)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=100, help="per method, path and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None, help="a real model too (zoo name)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.generations < 1 or args.rounds < 1:
        ap.error("--generations and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    import test_lossless_deep as deep  # the suite's models and methods

    target = deep.damped()
    close, far = deep.perturbed_copy(target, 0.35, seed=3), deep.perturbed_copy(target, 0.6, seed=4)
    lms = [target, close, far]
    methods = {m: deep.methods(target, close, far)[m] for m in ("chain_small_lm", "vertical_2", "dynamic_tree")}
    rows: dict[str, dict[bool, list[float]]] = {}
    for r in range(args.rounds):
        for direct in ((False, True) if r % 2 == 0 else (True, False)):
            set_path(lms, direct)
            for k in (1, 4):
                rows.setdefault(f"tiny forward k={k} (ms)", {}).setdefault(direct, []).append(forward_ms(target, k))
            for name, make in methods.items():
                drafter, gen = make(), torch.Generator().manual_seed(r)
                t0 = time.perf_counter()
                outs = [generate(target, deep.PROMPT, drafter=drafter, max_new_tokens=deep.L, generator=gen,
                                 stop_on_eos=False, sampling=SamplingConfig(temperature=1.0)).tokens for _ in range(args.generations)]
                ms = 1000 * (time.perf_counter() - t0) / args.generations
                rows.setdefault(f"{name}: one generation (ms)", {}).setdefault(direct, []).append(ms)
                rows.setdefault(f"{name} outputs", {})[direct] = outs
        for name in methods:
            both = rows[f"{name} outputs"]
            if len(both) == 2 and both[False] != both[True]:
                bad = next(i for i, (a, b) in enumerate(zip(both[False], both[True])) if a != b)
                raise SystemExit(f"{name}: the two paths sampled different tokens (round {r}, generation {bad}: "
                                 f"{both[False][bad]} vs {both[True][bad]})")
    if args.model:
        real = load_model(args.model, backend=args.dtype)
        for r in range(args.rounds):
            for direct in ((False, True) if r % 2 == 0 else (True, False)):
                set_path([real], direct)
                for k in (1, 4):
                    rows.setdefault(f"{args.model} {args.dtype} forward k={k} (ms)", {}).setdefault(direct, []).append(
                        forward_ms(real, k, repeats=10))
    print(f"medians over {args.rounds} interleaved rounds, {args.threads} thread(s)")
    print(f"{'':44s} {'transformers':>12s} {'direct':>9s} {'ratio':>7s}")
    for label, by_path in rows.items():
        if label.endswith("outputs"):
            continue
        hf, direct = statistics.median(by_path[False]), statistics.median(by_path[True])
        print(f"{label:44s} {hf:12.3f} {direct:9.3f} {hf / direct:7.2f}")
    print("generations equal on both paths: yes")


if __name__ == "__main__":
    main()
