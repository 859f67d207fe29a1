"""Core benchmark: chain speculative decoding vs autoregressive vs transformers, side by side.

For one target (default Qwen2.5-Coder-1.5B) on HumanEval prompts, greedy, in one process on the
same prompts (methods interleaved per prompt, after a warm-up of each):

  ar            cascade.generate, no drafter (the baseline every speedup is against)
  sps           cascade.generate + SmallLMDrafter (default Qwen2.5-Coder-0.5B)
  pld           cascade.generate + NGramDrafter (prompt lookup)
  hf_ar         transformers model.generate (greedy)
  hf_assisted   transformers model.generate(assistant_model=drafter) with its default settings
  hf_pld        transformers model.generate(prompt_lookup_num_tokens=...)
  sps_int8      cascade.generate + SmallLMDrafter on the int8 (dynamic, FBGEMM) drafter
  sps_head / sps_int8_head
                the same drafters with the LM head cut to the --head-vocab token ids most
                frequent in the HumanEval-solutions + GSM8K-answers corpora (FR-Spec;
                cascade.drafters.frequent_head; weights shared with sps / sps_int8)
  hf_ar_stock / hf_assisted_stock
                transformers' generate on a stock bf16 copy of the target (and bf16 drafter):
                what a user gets today, next to hf_ar on the same swapped modules as ours
                (e.g. --dtype fp16w: the framework tax, not the kernel's)

Prints tokens/s, tau, alpha, speedup vs `ar` and vs the transformers counterpart, the share of
step time spent outside model forwards, peak RSS, and every greedy divergence from `ar` with
the top-2 logit gap at that position (bf16 batched verification can flip near-ties).

    python experiments/bench_core.py --num-prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from cascade import generate, load_model
from cascade.data import encode_prompt, load_prompts
from cascade.drafters import NGramDrafter, SmallLMDrafter, frequent_head
from cascade.metrics import summarize


def hf_generate(target, ids, max_new, **kwargs) -> tuple[list[int], float]:
    inp = torch.tensor([ids], device=target.device)
    t0 = time.perf_counter()
    out = target.model.generate(
        inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
        pad_token_id=next(iter(target.eos_token_ids), 0), **kwargs,
    )
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="small-LM draft length (max)")
    ap.add_argument("--stop-below", type=float, default=0.4, help="small-LM confidence stop (HF's default is 0.4)")
    ap.add_argument("--pld-k", type=int, default=10, help="prompt-lookup max match (HF default 10)")
    ap.add_argument("--pld-ngram", type=int, default=2, help="prompt-lookup max n-gram (HF default 2)")
    ap.add_argument("--dtype", default="bfloat16", help="target dtype: bfloat16, float32, fp16w (FBGEMM fp16 weights), auto")
    ap.add_argument("--onednn", action="store_true", help="fp32 target with oneDNN linears (see cascade.models.cpu_kernels)")
    ap.add_argument("--drafter-dtype", default="bfloat16", help="small-LM drafter dtype (same names)")
    ap.add_argument("--head-vocab", type=int, default=32768, help="kept token ids of the *_head drafters' LM head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="ar,sps,pld,hf_ar,hf_assisted,hf_pld",
                    help="comma-separated subset of ar,sps,sps_int8,sps_head,sps_int8_head,pld,hf_ar,hf_assisted,hf_pld,hf_ar_stock,hf_assisted_stock "
                         "(ar is always run)")
    ap.add_argument("--json", help="write the full results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="float32" if args.onednn else args.dtype, onednn=args.onednn)
    draft_lm = load_model(args.drafter, dtype=args.drafter_dtype)
    prompts = [encode_prompt(target, p.text) for p in load_prompts(args.dataset, args.num_prompts)]
    chosen = set(args.methods.split(",")) | {"ar"}
    sps = SmallLMDrafter(draft_lm, k=args.k, stop_below=args.stop_below)
    pld = NGramDrafter(k=args.pld_k, max_ngram=args.pld_ngram)
    ours = {"ar": None, "sps": sps, "pld": pld}
    int8_lm = load_model(args.drafter, quantize="int8_dynamic") if chosen & {"sps_int8", "sps_int8_head"} else None
    if "sps_int8" in chosen:
        ours["sps_int8"] = SmallLMDrafter(int8_lm, k=args.k, stop_below=args.stop_below)
    if "sps_head" in chosen:
        ours["sps_head"] = SmallLMDrafter(frequent_head(draft_lm, args.head_vocab), k=args.k, stop_below=args.stop_below)
    if "sps_int8_head" in chosen:
        ours["sps_int8_head"] = SmallLMDrafter(frequent_head(int8_lm, args.head_vocab), k=args.k, stop_below=args.stop_below)
    stock = stock_draft = None
    if chosen & {"hf_ar_stock", "hf_assisted_stock"}:
        stock = load_model(args.target, dtype="bfloat16")
        stock_draft = load_model(args.drafter, dtype="bfloat16")
    theirs = {
        "hf_ar": (target, {}),
        "hf_assisted": (target, {"assistant_model": draft_lm.model}),
        "hf_pld": (target, {"prompt_lookup_num_tokens": args.pld_k, "max_matching_ngram_size": args.pld_ngram}),
        "hf_ar_stock": (stock, {}),
        "hf_assisted_stock": (stock, {"assistant_model": None if stock_draft is None else stock_draft.model}),
    }

    ours = {n: d for n, d in ours.items() if n in chosen}
    theirs = {n: v for n, v in theirs.items() if n in chosen}
    for name, drafter in ours.items():  # warm-up
        generate(target, prompts[0][:32], drafter=drafter, max_new_tokens=8)
    for model, kwargs in theirs.values():
        hf_generate(model, prompts[0][:32], 8, **kwargs)

    gens: dict[str, list] = {name: [] for name in ours}
    hf: dict[str, list[tuple[list[int], float]]] = {name: [] for name in theirs}
    for i, ids in enumerate(prompts):
        for name, drafter in ours.items():
            gens[name].append(generate(target, ids, drafter=drafter, max_new_tokens=args.max_new_tokens))
        for name, (model, kwargs) in theirs.items():
            hf[name].append(hf_generate(model, ids, args.max_new_tokens, **kwargs))
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n}={len(g[-1].tokens) / g[-1].wall_time_s:.2f}" for n, g in gens.items()
        ) + "  " + "  ".join(f"{n}={len(t) / s:.2f}" for n, (t, s) in ((n, v[-1]) for n, v in hf.items())) + " tok/s")

    rows = {name: summarize(g) for name, g in gens.items()}
    for name, runs in hf.items():
        tokens, secs = sum(len(t) for t, _ in runs), sum(s for _, s in runs)
        rows[name] = {"tokens_per_s": tokens / secs, "new_tokens": tokens, "wall_time_s": secs}
    base = rows["ar"]["tokens_per_s"]
    counterpart = {"ar": "hf_ar", "sps": "hf_assisted", "sps_int8": "hf_assisted", "sps_head": "hf_assisted",
                   "sps_int8_head": "hf_assisted", "pld": "hf_pld"}

    print(f"\ntarget {args.target}, drafter {args.drafter}, {args.dataset} x{len(prompts)}, greedy, "
          f"{args.max_new_tokens} new tokens, target {'fp32+oneDNN' if args.onednn else args.dtype}, "
          f"drafter {args.drafter_dtype}, {args.threads} threads")
    print(f"{'method':17s} {'tok/s':>7s} {'tau':>5s} {'alpha':>6s} {'c':>6s} {'speedup':>8s} {'vs HF':>6s} {'outside fwd':>11s}")
    for name, r in rows.items():
        c = next(iter(r.get("c_by_drafter", {}).values()), None)
        vs_hf = f"{r['tokens_per_s'] / rows[counterpart[name]]['tokens_per_s']:.2f}x" if counterpart.get(name) in rows else ""
        print(
            f"{name:17s} {r['tokens_per_s']:7.2f} {r.get('tau', float('nan')):5.2f} "
            f"{r['alpha'] if r.get('alpha') is not None else float('nan'):6.3f} {c if c is not None else float('nan'):6.3f} "
            f"{r['tokens_per_s'] / base:7.2f}x {vs_hf:>6s} {100 * r.get('overhead_frac', float('nan')):10.2f}%"
        )
    per_prompt = {n: [len(g.tokens) / g.wall_time_s for g in gs] for n, gs in gens.items()}
    print("median per-prompt tok/s: " + ", ".join(f"{n} {statistics.median(v):.2f}" for n, v in per_prompt.items()))
    divergences = []
    spec = [n for n in ("sps", "sps_int8", "sps_head", "sps_int8_head", "pld") if n in gens]
    for name in spec:
        for ids, a, b in zip(prompts, gens["ar"], gens[name]):
            j = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
            if j is not None:
                divergences.append({"method": name, "position": j, "top2_gap": target.top2_gap(ids + a.tokens[:j])})
    same = sum(1 for n in spec for a, b in zip(gens["ar"], gens[n]) if a.tokens == b.tokens)
    print(f"greedy outputs identical to ar: {same}/{len(spec) * len(prompts)}; divergences: {divergences or 'none'}")
    if "hf_ar_stock" in rows:
        print("vs transformers' stock bf16 autoregressive: " + ", ".join(
            f"{n} {r['tokens_per_s'] / rows['hf_ar_stock']['tokens_per_s']:.2f}x" for n, r in rows.items()))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss_mb:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "divergences": divergences, "peak_rss_mb": rss_mb}, f, indent=1)


if __name__ == "__main__":
    main()
