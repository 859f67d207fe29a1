"""Token trees on the real target: DyTC vs the best static tree, the best chain, the two-level
cascade and transformers' assisted generation, one run.

Qwen2.5-Coder-1.5B target (fp32 + oneDNN on CPUs without native bf16), HumanEval prompts,
greedy, every method interleaved per prompt after a warm-up:

    hf_assisted          transformers' generate(assistant_model=0.5B), its defaults
    chain_0.5b           the 0.5B (bf16) chain, k=6, confidence stop 0.4
    chain_int8           the int8 (dynamic) 0.5B chain, k=6
    csd_two_level        the 0.5B drafted for by prompt lookup
    static_tree_[...]    static trees of the 0.5B's top-w tokens (widths per depth)
    dytc                 dynamic tree over the 0.5B, prompt lookup and a layer skip of the target
    dytc_int8            dynamic tree over the int8 0.5B and prompt lookup

Prints τ, tokens/s, speedup against autoregressive decoding, the tree size, and writes the α̂/ĉ
trajectories of the dynamic trees (per step) to --trajectories (JSON) for the analysis figures.

    python experiments/bench_tree.py --num-prompts 3 --trajectories results/tree_trajectories.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cascade import generate, load_model
from cascade.cascades import VerticalCascade
from cascade.data import encode_prompt, load_prompts
from cascade.drafters import LayerSkipDrafter, NGramDrafter, QuantizedLMDrafter, SmallLMDrafter
from cascade.metrics import speedup, summarize
from cascade.tree import depths_of
from cascade.tree_drafter import DynamicTreePolicy, StaticTreePolicy, TreeDrafter

from bench_core import hf_generate  # experiments/ is on sys.path when a script here runs


def hf_assisted(target, assistant, ids, max_new):
    return hf_generate(target, ids, max_new, assistant_model=assistant.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--exit", type=int, default=6)
    ap.add_argument("--t-min", type=float, default=0.7)
    ap.add_argument("--max-nodes", type=int, default=24)
    ap.add_argument("--methods", default="", help="comma-separated subset")
    ap.add_argument("--trajectories", default="results/tree_trajectories.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="auto")
    small = load_model(args.small, dtype="bfloat16")
    small_int8 = load_model(args.small, quantize="auto")
    dyn = lambda: DynamicTreePolicy(t_min=args.t_min, max_nodes=args.max_nodes)  # noqa: E731
    makers = {
        "chain_0.5b": lambda: SmallLMDrafter(small, k=6, stop_below=0.4),
        "chain_int8": lambda: SmallLMDrafter(small_int8, k=6),
        "csd_two_level": lambda: VerticalCascade([SmallLMDrafter(small, k=8), NGramDrafter(k=4, max_ngram=2)]),
        "static_tree_2211": lambda: TreeDrafter([SmallLMDrafter(small)], StaticTreePolicy((2, 2, 1, 1))),
        "static_tree_3211": lambda: TreeDrafter([SmallLMDrafter(small_int8)], StaticTreePolicy((3, 2, 1, 1, 1))),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(small), NGramDrafter(k=1, max_ngram=2), LayerSkipDrafter(args.exit)], dyn(), calibrate=True),
        "dytc_int8": lambda: TreeDrafter([SmallLMDrafter(small_int8), NGramDrafter(k=1, max_ngram=2)], dyn(), calibrate=True),
    }
    wanted = [m for m in args.methods.split(",") if m] or ["hf_assisted", *makers]
    methods = {"ar": None, **{n: makers[n]() for n in wanted if n in makers}}
    prompts = [encode_prompt(target, p.text) for p in load_prompts("humaneval", args.num_prompts)]
    for drafter in methods.values():
        generate(target, prompts[0][:32], drafter=drafter, max_new_tokens=8)
    if "hf_assisted" in wanted:
        hf_assisted(target, small, prompts[0][:32], 8)
    gens = {name: [] for name in methods}
    hf = []
    for i, ids in enumerate(prompts):
        for name, drafter in methods.items():
            gens[name].append(generate(target, ids, drafter=drafter, max_new_tokens=args.max_new_tokens))
        if "hf_assisted" in wanted:
            hf.append(hf_assisted(target, small, ids, args.max_new_tokens))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    base = summarize(gens["ar"])
    print(f"\n{args.target} ({target.dtype}) <- {args.small}, humaneval x{len(prompts)}, greedy, {args.max_new_tokens} new tokens; "
          f"dytc t_min={args.t_min}, max_nodes={args.max_nodes}, exit={args.exit}")
    print(f"{'method':18s} {'tau':>5s} {'tok/s':>6s} {'speedup':>8s} {'nodes':>6s} {'pred':>6s}  identical")
    rows = {}
    for name, g in gens.items():
        s = summarize(g)
        same = all(a.tokens == b.tokens for a, b in zip(gens["ar"], g))
        nodes = s["tree_nodes_per_step"] if s["tree_nodes_per_step"] is not None else s["drafted_per_step"]
        pred = "-" if s["tree_expected_tau"] is None else f"{s['tree_expected_tau']:.2f}"
        print(f"{name:18s} {s['tau']:5.2f} {s['tokens_per_s']:6.2f} {speedup(s, base):7.2f}x {nodes:6.1f} {pred:>6s}  {same}")
        rows[name] = {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": speedup(s, base), "nodes_per_step": nodes}
    if hf:
        toks = sum(len(t) for t, _ in hf)
        tps = toks / sum(dt for _, dt in hf)
        same = all(a.tokens == t for a, (t, _) in zip(gens["ar"], hf))
        print(f"{'hf_assisted':18s} {'':>5s} {tps:6.2f} {tps / base['tokens_per_s']:7.2f}x {'':>6s} {'':>6s}  {same}")
        rows["hf_assisted"] = {"tokens_per_s": tps, "speedup": tps / base["tokens_per_s"]}
        for name in gens:
            if name != "ar":
                print(f"  {name} / hf_assisted: {rows[name]['tokens_per_s'] / tps:.2f}x")
    traj = {name: [{"step": st.step, "prompt": pi, "nodes": st.drafted, "depth": max(depths_of(st.parents), default=0),
                    "expected_accepted": st.tree.expected_accepted, "estimates": st.tree.estimates,
                    "accepted": st.accepted, "target_time_s": st.target_time_s, "draft_time_s": st.draft_time_s}
                   for pi, gen in enumerate(g) for st in gen.steps if st.tree is not None]
            for name, g in gens.items() if name.startswith("dytc")}
    out = Path(args.trajectories)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "trajectories": traj, "config": vars(args)}, indent=1))
    print(f"trajectories: {out}")


if __name__ == "__main__":
    main()
