"""Two-level vertical cascade vs the single small-LM drafter vs autoregressive, in one run.

Qwen2.5-Coder-1.5B target; the 0.5B drafter alone (chain), and the 0.5B drafted for by prompt
lookup (CS Drafting's vertical cascade); HumanEval prompts, greedy, methods interleaved per
prompt after a warm-up. Prints τ, α and c per level, the measured speedup and its in-sample
decomposition from the run's own α and c (the seed formula, with the measured verification cost,
and from the per-depth rates: ``metrics.decomposition``).

    python experiments/bench_cascade.py --num-prompts 4 --onednn
"""

from __future__ import annotations

import argparse

import torch

from cascade import load_model
from cascade.cascades import VerticalCascade
from cascade.data import encode_prompt, load_prompts
from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.metrics import decomposition, speedup, summarize
from cascade.run import decode_interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="tokens the 0.5B hands to the target per round")
    ap.add_argument("--k-ngram", type=int, default=4, help="tokens prompt lookup proposes to the 0.5B per inner round")
    ap.add_argument("--onednn", action="store_true", help="fp32 target with oneDNN linears")
    ap.add_argument("--dtype", default="bfloat16", help="target and drafter dtype (bfloat16, fp16w, auto, ...)")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="float32" if args.onednn else args.dtype, onednn=args.onednn)
    small = load_model(args.drafter, dtype="bfloat16" if args.onednn else args.dtype)
    prompts = [encode_prompt(target, p.text) for p in load_prompts(args.dataset, args.num_prompts)]
    methods = {
        "ar": None,
        "chain_0.5b": SmallLMDrafter(small, k=args.k),
        "csd_0.5b<-ngram": VerticalCascade([SmallLMDrafter(small, k=args.k), NGramDrafter(k=args.k_ngram, max_ngram=2)]),
    }
    gens = decode_interleaved(target, methods, prompts, args.max_new_tokens)

    base = summarize(gens["ar"])
    print(f"\n{args.target} <- {args.drafter}, {args.dataset} x{len(prompts)}, greedy, {args.max_new_tokens} new tokens, "
          f"target {'fp32+oneDNN' if args.onednn else args.dtype}, drafter {'bfloat16' if args.onednn else args.dtype}, k={args.k}, k_ngram={args.k_ngram}")
    print(f"{'method':18s} {'tok/s':>6s} {'tau':>5s} {'alpha':>6s} {'speedup':>8s} {'formula':>10s} {'formula+verify':>14s} {'decomposed':>11s}")
    for name, g in gens.items():
        s = summarize(g)
        p = decomposition(s, base)
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        alpha = "-" if s["alpha"] is None else f"{s['alpha']:.3f}"
        print(f"{name:18s} {s['tokens_per_s']:6.2f} {s['tau']:5.2f} {alpha:>6s} {speedup(s, base):7.2f}x "
              f"{fmt(p['formula_speedup']):>10s} {fmt(p['formula_speedup_verify_cost']):>14s} {fmt(p['decomposed_speedup_per_depth']):>11s}")
        c = next(iter(s["c_by_drafter"].values()), None)
        if c is not None:
            print(f"  whole drafter: c {c:.3f} (per drafted token, vs one verification forward), "
                  f"mean draft {s['drafted_per_step']:.2f}, verification forward {s['target_time_per_forward_s'] / base['target_time_per_forward_s']:.2f}x an AR step")
            print(f"  tau measured {s['tau']:.2f}; one-alpha formula (independent positions) {p['formula_tau_iid']:.2f}, "
                  f"per-depth decomposition {p['decomposed_tau_per_depth']:.2f}; alpha by depth "
                  + " ".join(f"{a:.2f}" for a in s["alpha_by_depth"]))
        for level, lv in s["levels"].items():
            print(f"  level {level}: alpha {lv['alpha']:.3f} (vs the level above), c {lv['c']:.3f}, drafted {lv['drafted']}")
    same = all(a.tokens == b.tokens for n in gens for a, b in zip(gens["ar"], gens[n]))
    print(f"greedy outputs identical to ar: {same}")


if __name__ == "__main__":
    main()
