"""Cost of one target forward over k new tokens (on a 200-token cache), relative to k = 1, every
backend side by side in one process, and where the time goes (per component).

This is the slack speculative verification lives on. Backends: bf16 (transformers' kernels),
fp32, fp32 with oneDNN linears, and fp16 weights with fp32 arithmetic through FBGEMM
(``dtype="fp16w"``, ``cascade.models.cpu_kernels``). The component table times, for k = 1 and
the largest k, the attention projections (q, k, v, o), the rest of attention (RoPE, the
softmax-weighted sum over the cache), the MLP, the LM head and everything else (embedding,
norms, framework), with forward hooks (they add a little overhead of their own).

    python experiments/forward_cost.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

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


def component_times(lm, k: int, repeats: int) -> dict[str, float]:
    """Seconds per forward of k tokens spent in each component (median over repeats)."""
    spent: dict[str, float] = defaultdict(float)
    start: dict[int, float] = {}
    hooks = []

    def timed(module, category):
        hooks.append(module.register_forward_pre_hook(lambda m, a: start.__setitem__(id(m), time.perf_counter())))
        hooks.append(module.register_forward_hook(
            lambda m, a, o: spent.__setitem__(category, spent[category] + time.perf_counter() - start[id(m)])))

    base = lm.model.get_decoder()
    for layer in base.layers:
        timed(layer.self_attn, "attention")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            timed(getattr(layer.self_attn, name), "attn_proj")
        timed(layer.mlp, "mlp")
    timed(lm.model.get_output_embeddings(), "lm_head")
    cache = lm.new_cache()
    lm.forward(list(range(100, 300)), cache, keep_last=1)
    past = lm.cache_len(cache)
    rows = []
    try:
        for _ in range(repeats + 1):
            spent.clear()
            t0 = time.perf_counter()
            lm.forward(list(range(1, k + 1)), cache)
            total = time.perf_counter() - t0
            lm.crop(cache, past)
            rows.append({"attn_proj": spent["attn_proj"], "attn_core": spent["attention"] - spent["attn_proj"],
                         "mlp": spent["mlp"], "lm_head": spent["lm_head"],
                         "other": total - spent["attention"] - spent["mlp"] - spent["lm_head"], "total": total})
    finally:
        for h in hooks:
            h.remove()
    return {key: statistics.median(r[key] for r in rows[1:]) for key in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", default="1,2,4,6,8,12,16,24,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="bf16,fp32,fp32+oneDNN,fp16w,dispatch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    known = {"bf16": dict(dtype="bfloat16"), "fp32": dict(dtype="float32"), "fp32+oneDNN": dict(dtype="float32", onednn=True),
             "fp16w": dict(dtype="fp16w"), "dispatch": dict(dtype="dispatch")}
    backends = {b: known[b] for b in args.backends.split(",")}
    print(f"{args.model}, {args.threads} threads, median of {args.repeats}; ms per forward (ratio to k=1)")
    print(f"{'backend':12s} " + " ".join(f"{'k=' + str(k):>14s}" for k in ks))
    components = {}
    for name, kwargs in backends.items():
        lm = load_model(args.model, **kwargs)
        times = forward_times(lm, ks, args.repeats)
        print(f"{name:12s} " + " ".join(f"{1000 * times[k]:7.0f} ({times[k] / times[1]:4.2f})" for k in ks), flush=True)
        components[name] = {k: component_times(lm, k, args.repeats) for k in (ks[0], ks[-1])}
        del lm
    keys = ["attn_proj", "attn_core", "mlp", "lm_head", "other", "total"]
    print("\nms per forward by component (hooks add some overhead; other = embedding, norms, framework)")
    print(f"{'backend':12s} {'k':>3s} " + " ".join(f"{c:>9s}" for c in keys))
    for name, by_k in components.items():
        for k, comp in by_k.items():
            print(f"{name:12s} {k:3d} " + " ".join(f"{1000 * comp[c]:9.1f}" for c in keys))


if __name__ == "__main__":
    main()
