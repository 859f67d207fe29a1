"""The drafter zoo on the real target: alpha, c, tau and speedup against autoregressive, one run.

Qwen2.5-Coder-1.5B target (fp32 + oneDNN on CPUs without native bf16, else bf16), HumanEval
prompts, greedy, every method interleaved per prompt after a warm-up, in one process:

    sps_0.5b           the 0.5B in bf16 (the reference chain drafter)
    quantized_0.5b     an int8 (dynamic) copy of the 0.5B
    quantized_self     an int8 (dynamic) copy of the 1.5B target itself
    layer_skip         the target's first --exit layers, sharing its weights and cache
    layer_skip_ts      the same with Thompson-sampling stop control
    layer_skip_deep    the target's first --late-exit layers
    kangaroo           the exit + the trained adapter (--adapter; skipped if the file is missing)
    double_early_exit  the --exit layers drafting for the --deep-exit layers of the target

    python experiments/bench_drafters.py --num-prompts 3 --adapter ~/.cache/cascade/adapters/qwen2.5-coder-1.5b-exit6.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cascade import load_model
from cascade.cascades import VerticalCascade
from cascade.data import encode_prompt, load_prompts
from cascade.drafters import ConfidenceStop, LayerSkipDrafter, QuantizedLMDrafter, SmallLMDrafter, ThompsonStop
from cascade.metrics import decomposition, speedup, summarize
from cascade.run import decode_interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--exit", type=int, default=6, help="shallow exit layer (28 layers in the 1.5B)")
    ap.add_argument("--deep-exit", type=int, default=14)
    ap.add_argument("--late-exit", type=int, default=20, help="exit of layer_skip_deep")
    ap.add_argument("--adapter", default=str(Path.home() / ".cache/cascade/adapters/qwen2.5-coder-1.5b-exit6.pt"))
    ap.add_argument("--methods", default="", help="comma-separated subset of the methods")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, dtype="auto")
    makers = {
        "sps_0.5b": lambda: SmallLMDrafter(load_model(args.small, dtype="bfloat16"), k=6),
        "quantized_0.5b": lambda: QuantizedLMDrafter(args.small, "auto", k=6),
        "quantized_self": lambda: QuantizedLMDrafter(args.target, "auto", k=6),
        "layer_skip": lambda: LayerSkipDrafter(args.exit, k=4),
        "layer_skip_ts": lambda: LayerSkipDrafter(args.exit, k=6, stop=ThompsonStop(0.5)),
        "layer_skip_deep": lambda: LayerSkipDrafter(args.late_exit, k=4),
        "kangaroo": lambda: LayerSkipDrafter(args.exit, k=6, adapter=args.adapter, stop=ConfidenceStop(0.6)),
        "double_early_exit": lambda: VerticalCascade([LayerSkipDrafter(args.deep_exit, k=6), LayerSkipDrafter(args.exit, k=3)]),
    }
    wanted = [m for m in args.methods.split(",") if m] or list(makers)
    methods = {"ar": None}
    for name in wanted:
        if name == "kangaroo" and not Path(args.adapter).expanduser().is_file():
            print(f"kangaroo skipped: no adapter at {args.adapter} (python -m cascade.train_adapter)")
            continue
        methods[name] = makers[name]()
    prompts = [encode_prompt(target, p.text) for p in load_prompts("humaneval", args.num_prompts)]
    gens = decode_interleaved(target, methods, prompts, args.max_new_tokens)

    base = summarize(gens["ar"])
    print(f"\n{args.target} ({target.dtype}), humaneval x{len(prompts)}, greedy, {args.max_new_tokens} new tokens, "
          f"exit {args.exit}, deep exit {args.deep_exit}, {args.threads} threads")
    print(f"{'method':18s} {'alpha':>6s} {'c':>6s} {'tau':>5s} {'tok/s':>6s} {'speedup':>8s} {'decomp.':>9s}  config")
    for name, g in gens.items():
        s = summarize(g)
        p = decomposition(s, base)
        c = next(iter(s["c_by_drafter"].values()), None)
        fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
        d = methods[name]
        desc = "-" if d is None else f"{d.name}, k={getattr(d, 'k', getattr(getattr(d, 'top', None), 'k', '?'))}"
        print(f"{name:18s} {fmt(s['alpha']):>6s} {fmt(c):>6s} {s['tau']:5.2f} {s['tokens_per_s']:6.2f} {speedup(s, base):7.2f}x "
              f"{fmt(p['decomposed_speedup_per_depth'], '{:.2f}x'):>9s}  {desc}")
        for level, lv in s["levels"].items():
            print(f"  level {level}: alpha {lv['alpha']:.3f}, c {lv['c']:.3f}")
    if "kangaroo" in methods:
        m = methods["kangaroo"].adapter.metrics
        print(f"adapter (exit {m.get('exit_layer')}): held-out top-1 agreement plain exit {m.get('alpha_exit', float('nan')):.3f}, "
              f"adapter init {m.get('alpha_adapter_init', float('nan')):.3f}, trained {m.get('alpha_adapter_trained', float('nan')):.3f}; "
              f"decoding alpha above")
    same = all(a.tokens == b.tokens for n in gens for a, b in zip(gens["ar"], gens[n]))
    print(f"greedy outputs identical to ar: {same}")


if __name__ == "__main__":
    main()
