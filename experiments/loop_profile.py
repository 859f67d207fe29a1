"""Where a decoding round's time goes outside the model forwards: the loop's own work.

Decodes a few HumanEval prompts greedily with autoregressive decoding and with one speculative
method (default: the int8 0.5B chain, k 6), then prints, per round and in autoregressive steps
(the baseline's time per token): the target's verification forward, the drafting, the
acceptance rule, and everything else (commit, observe, records: ``StepRecord.step_time_s``
minus the three). Then a cProfile of the speculative run: the functions with the most time of
their own, so that what the loop does besides the kernels is visible.

    python experiments/loop_profile.py [--prompts 3] [--tokens 64] [--drafter int8_native] [--k 6]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics

import torch
import transformers

from cascade import generate, load_model
from cascade.data import load_prompts
from cascade.drafters import SmallLMDrafter


def rounds(gen) -> dict[str, float]:
    """Seconds per round of each part of a generation's steps (medians over its rounds)."""
    parts = {"verify": [s.target_time_s for s in gen.steps], "draft": [s.draft_time_s for s in gen.steps],
             "accept": [s.accept_time_s or 0.0 for s in gen.steps]}
    parts["other"] = [s.step_time_s - s.target_time_s - s.draft_time_s - (s.accept_time_s or 0.0) for s in gen.steps]
    parts["tokens"] = [s.emitted for s in gen.steps]
    return {k: statistics.mean(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--drafter", default="int8_native", help="a quantize method for the 0.5B, or 'fp16' (the target's backend)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    target = load_model(args.target)
    small = load_model(args.small) if args.drafter == "fp16" else load_model(args.small, backend=args.drafter)
    prompts = [target.encode(p.text) for p in load_prompts("humaneval")[: args.prompts]]

    def drafter():  # ``small`` is already on its backend (loaded quantized): no copy per prompt
        return SmallLMDrafter(small, k=args.k)

    generate(target, prompts[0], drafter=drafter(), max_new_tokens=8)  # warm-up
    ar = [generate(target, p, max_new_tokens=args.tokens) for p in prompts]
    step = sum(g.wall_time_s - g.prefill_time_s for g in ar) / sum(len(g.tokens) for g in ar)  # s per AR token
    profiler = cProfile.Profile()
    profiler.enable()
    spec = [generate(target, p, drafter=drafter(), max_new_tokens=args.tokens) for p in prompts]
    profiler.disable()
    for name, gens in (("autoregressive", ar), (f"{args.drafter} 0.5B chain k {args.k}", spec)):
        per = [rounds(g) for g in gens]
        mean = {k: statistics.mean(r[k] for r in per) for k in per[0]}
        same = sum(g.tokens == a.tokens for g, a in zip(gens, ar))
        print(f"{name}: {mean['tokens']:.2f} tokens per round; per round in AR steps ({1000 * step:.1f} ms): "
              + ", ".join(f"{k} {mean[k] / step:.3f}" for k in ("verify", "draft", "accept", "other"))
              + f"; identical to AR {same}/{len(gens)}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print("\ncProfile of the speculative run (sorted by own time; the kernels are the native calls):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:8000])


if __name__ == "__main__":
    main()
