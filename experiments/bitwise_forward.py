"""Is a k-token verification forward bitwise k one-token steps? On a real model and backend.

For k = 2..16 (default), feeds k tokens after a real prompt in one forward and the same k tokens
one at a time, and compares the logits bit for bit. Where they differ it says which operation
first differs (hooks on the first decoder layer's modules: norms, projections, attention, MLP;
then the final norm and the LM head). On the native backend every k should be bitwise equal
(row-invariant kernels); on FBGEMM's fp16w or bf16 they are not, and the table says where.

    python experiments/bitwise_forward.py [--model qwen2.5-coder-1.5b] [--dtype native] [--ks 2-16]
"""

from __future__ import annotations

import argparse

import torch
import transformers

from cascade import load_model

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def first_difference(lm, cache, past: int, tokens: list[int]) -> str:
    """The first module (in forward order) whose outputs differ between the batched forward and
    the one-token steps."""
    base = lm.model.get_decoder()
    layer = base.layers[0]
    modules = [("embed", base.embed_tokens), ("input_layernorm", layer.input_layernorm),
               ("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj), ("v_proj", layer.self_attn.v_proj),
               ("attention core (o_proj input)", layer.self_attn.o_proj), ("post_attention_layernorm", layer.post_attention_layernorm),
               ("mlp down_proj", layer.mlp.down_proj), ("final norm", base.norm), ("lm_head", lm.model.get_output_embeddings())]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in modules:
        if name.startswith("attention core"):  # what enters o_proj is the attention's output
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, name=name: seen.setdefault(name, []).append(a[0].detach().reshape(-1, a[0].shape[-1]).clone())))
        else:
            hooks.append(module.register_forward_hook(
                lambda m, a, o, name=name: seen.setdefault(name, []).append(o.detach().reshape(-1, o.shape[-1]).clone())))
    try:
        with lm.module_calls():  # every module called as a module, so that the hooks see it
            lm.crop(cache, past)
            lm.forward(tokens, cache)
            batched = {n: v[0] for n, v in seen.items()}
            seen.clear()
            lm.crop(cache, past)
            for t in tokens:
                lm.forward([t], cache)
        for name, _ in modules:
            single = torch.cat(seen[name])
            if not torch.equal(batched[name], single):
                return f"{name} (max |diff| {(batched[name] - single).abs().max().item():.3g})"
        return "none of the hooked modules (later layers)"
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="native")
    ap.add_argument("--ks", default="2-16", help="a range a-b or a comma list")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    lo, _, hi = args.ks.partition("-")
    ks = list(range(int(lo), int(hi) + 1)) if hi else [int(k) for k in args.ks.split(",")]
    lm = load_model(args.model, backend=args.dtype)
    cache = lm.new_cache()
    lm.forward(lm.encode(PROMPT), cache)
    past = lm.cache_len(cache)
    tokens = [(1000 + 7919 * i) % lm.vocab_size for i in range(max(ks))]
    print(f"{args.model} on {args.dtype}: {past}-token prompt; logits of a k-token forward against k one-token steps")
    equal = 0
    for k in ks:
        lm.crop(cache, past)
        batched = lm.forward(tokens[:k], cache)
        lm.crop(cache, past)
        single = torch.cat([lm.forward([t], cache) for t in tokens[:k]])
        if torch.equal(batched, single):
            equal += 1
            print(f"k={k:2d}: bitwise equal")
        else:
            gap = (batched - single).abs().max().item()
            print(f"k={k:2d}: differ (max |diff| {gap:.3g}); first differing operation: {first_difference(lm, cache, past, tokens[:k])}")
    print(f"{equal}/{len(ks)} bitwise equal")


if __name__ == "__main__":
    main()
