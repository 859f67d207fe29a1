"""Token trees on the real target, level by level: DyTC against the best chain, static trees, the
EAGLE-2-style reranked tree and transformers' assisted generation, one run.

Qwen2.5-Coder-1.5B target (``--dtype``, default auto), greedy, 64 new tokens, every method interleaved
per prompt after a warm-up, on three prompt sets:

    humaneval      code completion (the first --num-prompts HumanEval prompts)
    gsm8k          math word problems as plain text (the first --num-prompts)
    gsm8k_chat     held-out GSM8K questions (the last --chat-prompts) through the chat template,
                   where drafting barely pays: the do-no-harm case for a cost-aware policy

Methods (the small drafter is the int8 0.5B, the fastest chain drafter on these CPUs, unless
named ``_bf16``):

    ar                   autoregressive decoding (the same loop with an empty draft)
    chain_int8           chain, k=6                      chain_bf16: the bf16 0.5B, k=6, confidence stop 0.4
    static_2211 / _3211  static trees (widths per depth), children ranked by the drafter
    reranked             EAGLE-2: top-3 expansion for 6 levels, the 12 best nodes verified
    dytc                 DyTC priced per level over the int8 0.5B and prompt lookup
    hf_assisted          transformers' generate(assistant_model=bf16 0.5B), its defaults

Columns: τ (tokens per target forward), tok/s, speedup against ar in the same run, drafted
nodes per step, LM drafter forwards per step (level by level: at most depth + 1), and the
policy's own expected τ (its estimate when it grew the trees). Writes the rows and the DyTC
α̂ / ĉ trajectories to --out (JSON).

    python experiments/bench_tree.py --num-prompts 4 --chat-prompts 3 --out results/bench_tree.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cascade import generate, load_model
from cascade.data import encode_prompt, load_prompts
from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.metrics import speedup, summarize
from cascade.tree import depths_of
from cascade.tree_drafter import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy, TreeDrafter

from bench_core import hf_generate  # experiments/ is on sys.path when a script here runs


def prompt_sets(target, n: int, n_chat: int) -> dict[str, list[list[int]]]:
    chat = load_prompts("gsm8k")[-n_chat:] if n_chat else []
    sets = {
        "humaneval": [encode_prompt(target, p.text) for p in load_prompts("humaneval", n)],
        "gsm8k": [encode_prompt(target, p.text) for p in load_prompts("gsm8k", n)],
        "gsm8k_chat": [encode_prompt(target, p.text, chat_template=True) for p in chat],
    }
    return {k: v for k, v in sets.items() if v}


def divergence_gaps(target, prompts, ref, other) -> list[float]:
    """Top-2 logit gap of the target at the first token where ``other`` leaves greedy decoding
    ``ref`` (a near-tie, where batched and one-token numerics may round differently)."""
    gaps = []
    for ids, a, b in zip(prompts, ref, other):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is not None:
            gaps.append(round(target.top2_gap(ids + a[:diff]), 4))
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="auto", help="target dtype (auto, bfloat16, fp16w, ...)")
    ap.add_argument("--num-prompts", type=int, default=4, help="HumanEval and GSM8K prompts each")
    ap.add_argument("--chat-prompts", type=int, default=3, help="held-out GSM8K questions through the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--t-min", type=float, default=0.7)
    ap.add_argument("--max-nodes", type=int, default=24)
    ap.add_argument("--methods", default="", help="comma-separated subset (ar always runs)")
    ap.add_argument("--out", default="results/bench_tree.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype=args.dtype)
    small_int8 = load_model(args.small, quantize="auto")
    small_bf16 = None
    makers = {
        "chain_int8": lambda: SmallLMDrafter(small_int8, k=6),
        "chain_bf16": lambda: SmallLMDrafter(small_bf16, k=6, stop_below=0.4),
        "static_2211": lambda: TreeDrafter([SmallLMDrafter(small_int8)], StaticTreePolicy((2, 2, 1, 1))),
        "static_3211": lambda: TreeDrafter([SmallLMDrafter(small_int8)], StaticTreePolicy((3, 2, 1, 1, 1))),
        "reranked": lambda: TreeDrafter([SmallLMDrafter(small_int8)], RerankedTreePolicy(top_k=3, depth=6, max_nodes=12)),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(small_int8), NGramDrafter(k=1, max_ngram=2)],
                                    DynamicTreePolicy(t_min=args.t_min, max_nodes=args.max_nodes), calibrate=True),
    }
    wanted = [m for m in args.methods.split(",") if m] or [*makers, "hf_assisted"]
    unknown = set(wanted) - set(makers) - {"ar", "hf_assisted"}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {sorted(makers) + ['hf_assisted']}")
    if "chain_bf16" in wanted or "hf_assisted" in wanted:
        small_bf16 = load_model(args.small, dtype="bfloat16")
    methods = {"ar": None, **{n: makers[n]() for n in wanted if n in makers}}
    sets = prompt_sets(target, args.num_prompts, args.chat_prompts)

    warm = next(iter(sets.values()))[0][:32]
    for drafter in methods.values():
        generate(target, warm, drafter=drafter, max_new_tokens=8)
    if "hf_assisted" in wanted:
        hf_generate(target, warm, 8, assistant_model=small_bf16.model)

    gens = {s: {name: [] for name in methods} for s in sets}
    hf = {s: [] for s in sets}
    t0, done, total = time.perf_counter(), 0, sum(len(v) for v in sets.values())
    for set_name, prompts in sets.items():
        for ids in prompts:
            for name, drafter in methods.items():
                gens[set_name][name].append(generate(target, ids, drafter=drafter, max_new_tokens=args.max_new_tokens))
            if "hf_assisted" in wanted:
                hf[set_name].append(hf_generate(target, ids, args.max_new_tokens, assistant_model=small_bf16.model))
            done += 1
            print(f"{set_name}: prompt {done}/{total} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    rows = {}
    print(f"\n{args.target} ({target.dtype}) <- {args.small} (int8 unless _bf16), greedy, {args.max_new_tokens} new tokens; "
          f"dytc t_min={args.t_min}, max_nodes={args.max_nodes}; {torch.get_num_threads()} threads")
    for set_name in sets:
        base = summarize(gens[set_name]["ar"])
        print(f"\n[{set_name}] x{len(sets[set_name])}")
        print(f"{'method':12s} {'tau':>5s} {'tok/s':>6s} {'speedup':>8s} {'nodes':>6s} {'fwd':>5s} {'exp.tau':>7s}  identical")
        rows[set_name] = {}
        for name, g in gens[set_name].items():
            s = summarize(g)
            gaps = divergence_gaps(target, sets[set_name], [a.tokens for a in gens[set_name]["ar"]], [b.tokens for b in g])
            same = True if not gaps else f"no (top-2 gaps {gaps})"
            nodes = s["tree_nodes_per_step"] if s["tree_nodes_per_step"] is not None else s["drafted_per_step"]
            fwd = s["tree_drafter_forwards_per_step"]
            exp = s["tree_expected_tau"]
            print(f"{name:12s} {s['tau']:5.2f} {s['tokens_per_s']:6.2f} {speedup(s, base):7.2f}x {nodes:6.1f} "
                  f"{'-' if fwd is None else f'{fwd:.1f}':>5s} {'-' if exp is None else f'{exp:.2f}':>7s}  {same}")
            rows[set_name][name] = {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": speedup(s, base),
                                    "nodes_per_step": nodes, "drafter_forwards_per_step": fwd, "expected_tau": exp,
                                    "identical": same}
        if hf[set_name]:
            toks = sum(len(t) for t, _ in hf[set_name])
            tps = toks / sum(dt for _, dt in hf[set_name])
            gaps = divergence_gaps(target, sets[set_name], [a.tokens for a in gens[set_name]["ar"]], [t for t, _ in hf[set_name]])
            same = True if not gaps else f"no (top-2 gaps {gaps})"
            print(f"{'hf_assisted':12s} {'':>5s} {tps:6.2f} {tps / base['tokens_per_s']:7.2f}x {'':>6s} {'':>5s} {'':>7s}  {same}")
            rows[set_name]["hf_assisted"] = {"tokens_per_s": tps, "speedup": tps / base["tokens_per_s"], "identical": same}
        chains = [n for n in rows[set_name] if n.startswith("chain")]
        if "dytc" in rows[set_name] and chains:
            best = max(chains, key=lambda n: rows[set_name][n]["speedup"])
            trees = [n for n in rows[set_name] if n.startswith(("static", "reranked"))]
            print(f"  dytc / best chain ({best}): {rows[set_name]['dytc']['speedup'] / rows[set_name][best]['speedup']:.2f}x; "
                  + ", ".join(f"dytc / {n}: {rows[set_name]['dytc']['speedup'] / rows[set_name][n]['speedup']:.2f}x" for n in trees))
    traj = {set_name: [{"step": st.step, "prompt": pi, "nodes": st.drafted, "depth": max(depths_of(st.parents), default=0),
                        "expected_accepted": st.tree.expected_accepted, "drafter_forwards": st.tree.drafter_forwards,
                        "estimates": st.tree.estimates, "accepted": st.accepted, "target_time_s": st.target_time_s,
                        "draft_time_s": st.draft_time_s}
                       for pi, gen in enumerate(gens[set_name]["dytc"]) for st in gen.steps if st.tree is not None]
            for set_name in sets if "dytc" in methods}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "trajectories": traj, "config": vars(args)}, indent=1))
    print(f"rows and trajectories: {out}")


if __name__ == "__main__":
    main()
