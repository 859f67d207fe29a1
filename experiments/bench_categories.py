"""Every drafter, and cascades / a tree over them, per task category, in one run.

Qwen2.5-Coder-1.5B target, the ``mixed`` prompt set (``cascade.data.mixed``: the first
``--per-category`` prompts of MT-bench's 8 categories through the chat template, HumanEval
completion, GSM8K and GPQA through the chat template), greedy, 64 new tokens, every method
interleaved per prompt after a warm-up (prompts go round-robin over the categories).

Methods (backend ``--dtype``, default auto = fp16w on these CPUs, for target and small LM):

    ar                  autoregressive decoding
    pld                 prompt lookup (n-gram over the context), k=10 as the pld config
    recycling           Token Recycling chain, k=4, r=8 (table of the target's top-8, kept across prompts)
    recycling_gated     the same, k=6, a path stops where its recorded probability < 0.5 (min_prob)
    recycling_tree      Token Recycling static tree, widths (2, 1, 1) (6 nodes), min_prob 0.3
    suffix              suffix lookup: HumanEval / GSM8K corpora (disjoint from the prompts) + the context
    chain_0.5b          the 0.5B small LM, chain k=5
    csd_0.5b<-recycling vertical cascade: the 0.5B (k=--cascade-k, default 5 as the chain: under
                        greedy the cascade hands up exactly the 0.5B's own tokens, so the same k
                        gives the same τ and only the cost differs) drafted by Token Recycling
                        (k=3, min_prob --bottom-min-prob; its own table, learned from the 0.5B's
                        inner verifications)
    csd_0.5b<-suffix    the same with suffix lookup as the bottom level
    dytc                DyTC tree over the 0.5B, Token Recycling and suffix lookup

Token Recycling's table starts empty and is kept across prompts (as in the paper), so with
``--warm N`` each recycling drafter first decodes N held-out prompts per category (not timed,
not in the table); 0 shows the cold start.

Prints τ and speedup against ``ar`` per category and overall; writes the rows to --out (JSON)
and the figure of speedup by category next to it (--fig).

    python experiments/bench_categories.py --per-category 3 --out results/bench_categories.json --fig docs/figures
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from cascade import generate, load_model
from cascade.cascades import VerticalCascade
from cascade.data import encode, load_prompts, mixed
from cascade.drafters import NGramDrafter, SmallLMDrafter, SuffixDrafter, TokenRecyclingDrafter
from cascade.metrics import speedup, summarize
from cascade.run import by_category, decode_interleaved
from cascade.tree_drafter import DynamicTreePolicy, TreeDrafter

CORPORA = ["humaneval_solutions", "gsm8k_answers"]


def build_methods(small, target, cascade_k: int = 5, bottom_min_prob: float = 0.5) -> dict:
    suffix = lambda k: SuffixDrafter(corpus=CORPORA, k=k)  # noqa: E731
    methods = {
        "ar": None,
        "pld": NGramDrafter(k=10, max_ngram=2),
        "recycling": TokenRecyclingDrafter(r=8, k=4),
        "recycling_gated": TokenRecyclingDrafter(r=8, k=6, min_prob=0.5),
        "recycling_tree": TokenRecyclingDrafter(r=8, tree=(2, 1, 1), min_prob=0.3),
        "suffix": suffix(8),
        "chain_0.5b": SmallLMDrafter(small, k=5),
        "csd_0.5b<-recycling": VerticalCascade([SmallLMDrafter(small, k=cascade_k),
                                                TokenRecyclingDrafter(r=8, k=3, min_prob=bottom_min_prob)]),
        "csd_0.5b<-suffix": VerticalCascade([SmallLMDrafter(small, k=cascade_k), suffix(3)]),
        "dytc": TreeDrafter([SmallLMDrafter(small), TokenRecyclingDrafter(r=8, k=1), suffix(1)], DynamicTreePolicy(max_nodes=12)),
    }
    for d in methods.values():
        if d is not None:
            d.check_compatible(target)  # builds the suffix datastores once, before timing
    return methods


def warm(target, methods: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Decode held-out prompts with every method holding a recycling table (filling it; the
    tree's estimates warm up too)."""
    for name, d in methods.items():
        if d is not None and ("recycling" in name or name == "dytc"):
            for ids in prompts:
                generate(target, ids, drafter=d, max_new_tokens=max_new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--warm", type=int, default=1, help="held-out prompts per category decoded first by recycling drafters")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cascade-k", type=int, default=5, help="the 0.5B's k inside the cascades (the chain's is 5)")
    ap.add_argument("--bottom-min-prob", type=float, default=0.5, help="min_prob of Token Recycling as a cascade's bottom level")
    ap.add_argument("--methods", default=None, help="comma-separated subset (ar is always run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON of the per-category rows")
    ap.add_argument("--fig", default=None, help="directory for the speedup-by-category figure")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype=args.dtype)
    small = load_model(args.small, dtype=args.dtype)
    prompt_set = load_prompts("mixed", per_category=args.per_category)
    prompts = [encode(target, p) for p in prompt_set]
    methods = build_methods(small, target, args.cascade_k, args.bottom_min_prob)
    if args.methods:
        keep = {"ar", *args.methods.split(",")}
        methods = {k: v for k, v in methods.items() if k in keep}
    if args.warm:  # prompts after the measured ones in each category
        held = mixed(args.per_category + args.warm)[len(prompt_set):]
        t0 = time.perf_counter()
        warm(target, methods, [encode(target, p) for p in held], args.max_new_tokens)
        print(f"warmed recycling tables on {len(held)} held-out prompts ({time.perf_counter() - t0:.0f} s)")

    t0 = time.perf_counter()
    gens = decode_interleaved(target, methods, prompts, args.max_new_tokens)
    wall = time.perf_counter() - t0
    cats = list(dict.fromkeys(p.category for p in prompt_set))
    base = summarize(gens["ar"])
    rows = {}
    for name, g in gens.items():
        s = summarize(g)
        rows[name] = {"overall": {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": speedup(s, base)},
                      "by_category": by_category(prompt_set, g, gens["ar"]),
                      "identical_to_ar": sum(a.tokens == b.tokens for a, b in zip(gens["ar"], g))}

    print(f"\n{args.target} <- {args.small}, mixed x{len(prompts)} ({args.per_category} per category), greedy, "
          f"{args.max_new_tokens} new tokens, backend {args.dtype}, "
          f"recycling warm-up {args.warm}/category, {wall / 60:.1f} min")
    for metric in ("speedup", "tau"):
        print(f"\n{metric} by category")
        print(f"{'method':21s} " + " ".join(f"{c.replace('mtbench/', 'mt/')[:10]:>10s}" for c in cats) + f" {'overall':>8s}")
        for name, r in rows.items():
            vals = [r["by_category"][c][metric] for c in cats]
            print(f"{name:21s} " + " ".join(f"{v:10.2f}" for v in vals) + f" {r['overall'][metric]:8.2f}")
    print("\noutputs identical to ar: " + ", ".join(f"{n} {r['identical_to_ar']}/{len(prompts)}" for n, r in rows.items()))
    if "recycling" in rows and "pld" in rows:
        ahead = [c for c in cats if rows["recycling"]["by_category"][c]["speedup"] > rows["pld"]["by_category"][c]["speedup"]]
        print(f"recycling ahead of pld in {len(ahead)}/{len(cats)} categories")
    for casc in ("csd_0.5b<-recycling", "csd_0.5b<-suffix"):
        if casc in rows and "chain_0.5b" in rows:
            print(f"{casc}: {rows[casc]['overall']['speedup']:.2f}x vs chain_0.5b {rows['chain_0.5b']['overall']['speedup']:.2f}x overall")

    config = {"target": args.target, "small": args.small, "dtype": args.dtype, "per_category": args.per_category,
              "warm": args.warm, "max_new_tokens": args.max_new_tokens, "cascade_k": args.cascade_k,
              "bottom_min_prob": args.bottom_min_prob, "prompts": [p.id for p in prompt_set]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps({"config": config, "categories": cats, "rows": rows}, indent=1))
        tmp.replace(args.out)
    if args.fig:
        from analysis import figures

        speed = {n: [r["by_category"][c]["speedup"] for c in cats] + [r["overall"]["speedup"]] for n, r in rows.items() if n != "ar"}
        _, paths = figures.speedup_by_category(speed, cats + ["overall"],
                                               f"{args.target}, mixed set ({args.per_category}/category), greedy, same run",
                                               args.fig)
        print(*paths, sep="\n")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
