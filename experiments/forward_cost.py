"""Cost of one target forward over k new tokens (on a 200-token cache), relative to k = 1, every
backend side by side in one process, and where the time goes (per component).

This is the slack speculative verification lives on. Backends: bf16 (transformers' kernels),
fp32, fp32 with oneDNN linears, fp16 weights with fp32 arithmetic through FBGEMM
(``dtype="fp16w"``, ``cascade.models.backends.cpu_kernels``) or through cascade's native row-invariant
kernels (``native``: ``dtype="native"``, ``cascade.models.backends.native``, with its lean forward, each
layer two native calls; ``native_ops``: the lean forward a Python call per operation;
``native_hf``: the same kernels under transformers' own forward), and the drafters' quantized
copies (``int8``: torch's dynamic int8; ``int8n`` / ``int4n``: the native weight-only kernels;
``int8v`` / ``int4v``: native int8 / int4 weights times int8 activations quantized per row,
AVX-512 VNNI). The component table times, for k = 1 and
the largest k, the attention projections (q, k, v, o), the rest of attention (RoPE, the
softmax-weighted sum over the cache), the MLP, the LM head and everything else (embedding,
norms, framework), with forward hooks (they add a little overhead of their own).

The roofline (``--roofline``, on by default) measures this machine's memory read bandwidth (the
native streaming read at the kernels' prefetch distance over 1 GiB, into L1 and into L2, its fastest pass the bound,
torch's fp32 sum beside it; once per repeat between the forwards: the host's bandwidth drifts,
and a floor of another moment than the forwards would misstate their ratio to it) and its arithmetic peak (the faster of fp32 sgemm at 2048^3 and FBGEMM's
fp16-weight GEMM at 512 rows), counts the model's linear weights, and prints the floor
``theory.forward_floor_s`` for every k (16-bit weights read once, arithmetic at the measured
peak, the two overlapped; and the sum of the two, a kernel that does not overlap them), each
backend's time over that floor, and the 1-token forward's tokens per second as a
fraction of the probe bound for the bytes that backend reads (above 100%: the probe is not a
bound there, said so, and no goal is called met on it). For a backend on native
kernels a "<backend> linears" row times the model's linear layers alone, called one after
another on k random rows in the same repeats as the forwards: their ratio to the floor is the
kernels' own efficiency, and the forward minus it is what the rest of the forward costs.
Where the floor's own k-token / 1-token ratio is above a goal, no exact kernel can meet that goal on this machine. ``--prefill N``
(default 256; 0: skip) times an N-token forward on an empty cache per backend and prints its
GFLOP/s against the measured fp32 peak.

    python experiments/forward_cost.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import transformers

from cascade import load_model
from cascade.models.backends.lean import FusedLayer, LeanDecoder
from cascade.theory import forward_floor_s
from cascade.timing import Bandwidth, ReadProbe, median_s


def peak_flops(repeats: int = 5) -> dict[str, float]:
    """FLOP/s of the two dense kernels this project's exact backends run, on shapes large
    enough to be compute-bound: fp32 sgemm 2048^3 and FBGEMM's fp16-weight GEMM at 512 rows of
    a 1536 -> 8960 projection (the 1.5B's gate/up shape)."""
    out = {}
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out["sgemm"] = 2 * 2048 ** 3 / median_s(lambda: a @ b, repeats)
    if "fbgemm" in torch.backends.quantized.supported_engines:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(8960, 1536) * 0.02, None)
        x = torch.randn(512, 1536)
        out["fbgemm_fp16w"] = 2 * 512 * 1536 * 8960 / median_s(lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed), repeats)
    return out


def linear_params(lm) -> int:
    """Weights of every linear layer (LM head included), whatever module type holds them:
    what one forward multiplies by, per token."""
    total = 0
    for module in lm.model.modules():
        if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int):
            total += module.in_features * module.out_features
    return total


def forward_times(lms: dict, ks, repeats: int, probe_gib: float = 0.0) -> tuple[dict[str, dict[int, float]], float | None]:
    """Median seconds of a k-token forward on a 200-token cache, for every backend and k, both
    interleaved (each repeat runs every k on every backend), so that the shared machine's drifts
    in memory bandwidth hit all backends and all k alike (the ratios to k = 1 are within a repeat's
    span, not across the run's). ``probe_gib`` > 0: the read probe (a sum over that many GiB of
    fp32) and the native streaming read run once per repeat between the forwards, and their
    ``Bandwidth`` (the native reads' fastest: the bound; torch's sum's median beside it) is returned
    beside the times, so that the roofline's floor is of the same moments as the forwards."""
    caches, bases = {}, {}
    for name, lm in lms.items():
        caches[name] = lm.new_cache()
        lm.forward([t % lm.vocab_size for t in range(100, 300)], caches[name], keep_last=1)
        bases[name] = lm.cache_len(caches[name])
    samples = {name: {k: [] for k in ks} for name in lms}
    alone = {f"{name} linears": linears for name, lm in lms.items() if (linears := native_linears(lm))}
    samples.update({name: {k: [] for k in ks} for name in alone})
    probe = ReadProbe(probe_gib) if probe_gib > 0 else None
    probe_s, native_s = [], []
    for _ in range(repeats + 1):  # the first round is a warm-up
        if probe is not None:
            sum_s, native = probe.time_reads()  # native: one pass prefetching into L1, one into L2
            probe_s.append(sum_s)
            if native:
                native_s.append(min(native))
        for k in ks:
            for name, lm in lms.items():
                t0 = time.perf_counter()
                lm.forward(list(range(1, k + 1)), caches[name])
                samples[name][k].append(time.perf_counter() - t0)
                lm.crop(caches[name], bases[name])
            for name, linears in alone.items():
                samples[name][k].append(linears_pass_s(linears, k))
    times = {name: {k: statistics.median(v[1:]) for k, v in by_k.items()} for name, by_k in samples.items()}
    if probe is None:
        return times, None
    return times, Bandwidth(probe.nbytes / min(native_s[1:]) if len(native_s) > 1 else None,
                            probe.nbytes / statistics.median(probe_s[1:]))


def gguf_linear_bytes(lm) -> int:
    """Bytes of the GGUF blocks the model's linear layers read per forward (the embedding's,
    read one row per token, not counted)."""
    from cascade.models.backends.gguf_weights import NativeGGUFLinear

    return sum(m.blocks.numel() for m in lm.model.modules() if isinstance(m, NativeGGUFLinear))


def native_linears(lm) -> list:
    """The model's native linear modules in the order its forward calls them (LM head last);
    empty for a backend on other kernels."""
    from cascade.models.backends.native import NativeLinear

    return [m for m in lm.model.modules() if isinstance(m, NativeLinear)]


def linears_pass_s(linears: list, k: int) -> float:
    """Seconds to call every linear once on k rows, one call after another with nothing
    between them: the forward's kernels without the rest of the forward (norms, RoPE,
    attention, framework). Each layer is its own call (the lean forward joins q / k / v and
    gate / up into one), on one random input per width, made before the clock starts."""
    inputs = {m.in_features: torch.randn(k, m.in_features) for m in linears}
    t0 = time.perf_counter()
    for m in linears:
        m(inputs[m.in_features])
    return time.perf_counter() - t0


def prefill_time(lm, n: int, repeats: int) -> float:
    """Seconds of an n-token forward on an empty cache (median of repeats, after a warm-up)."""
    ids = [t % lm.vocab_size for t in range(100, 100 + n)]
    samples = []
    for _ in range(repeats + 1):
        cache = lm.new_cache()
        t0 = time.perf_counter()
        lm.forward(ids, cache, keep_last=1)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def component_times(lm, k: int, repeats: int) -> dict[str, float]:
    """Seconds per forward of k tokens spent in each component (median over repeats).

    attn_proj: the q, k, v, o linears; attn_core: the rest of the attention module (RoPE, the
    cache write, the product over the cache) on transformers' forward, the native attention
    kernel alone on the lean forward (which calls no attention module: its RoPE and cache write
    fall in other); mlp: the MLP module on transformers' forward, its three linears on the lean
    forward (the activation then falls in other); lm_head; other: the rest (embedding, norms,
    framework). A lean forward with two-call layers is timed as its per-operation twin, the
    direct forward with every module called as a module (hooks see only module calls): what
    the two calls and the written-out layers save shows in the main table, not here."""
    if not isinstance(lm.lean, LeanDecoder):
        with lm.module_calls():  # the direct forward's written-out layers as module calls (hooks fire)
            return _component_times(lm, k, repeats)
    if not any(isinstance(layer, FusedLayer) for layer in lm.lean.layers):
        return _component_times(lm, k, repeats)
    fused = lm.lean
    lm.use_forward(LeanDecoder(lm.model, fused_layers=False))
    try:
        return _component_times(lm, k, repeats)
    finally:
        lm.use_forward(fused)


def _component_times(lm, k: int, repeats: int) -> dict[str, float]:
    from cascade.models.backends import native

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
        timed(layer.mlp, "mlp_module")
        for name in ("gate_proj", "up_proj", "down_proj"):
            timed(getattr(layer.mlp, name), "mlp_linears")
    timed(lm.model.get_output_embeddings(), "lm_head")
    kernel = native.attention_kernel

    def timed_kernel(*args):
        t0 = time.perf_counter()
        out = kernel(*args)
        spent["kernel"] += time.perf_counter() - t0
        return out

    native.attention_kernel = timed_kernel
    cache = lm.new_cache()
    lm.forward([t % lm.vocab_size for t in range(100, 300)], cache, keep_last=1)
    past = lm.cache_len(cache)
    rows = []
    try:
        for _ in range(repeats + 1):
            spent.clear()
            t0 = time.perf_counter()
            lm.forward(list(range(1, k + 1)), cache)
            total = time.perf_counter() - t0
            lm.crop(cache, past)
            lean = spent["attention"] == 0  # the lean forward calls no attention module
            attention = spent["attn_proj"] + spent["kernel"] if lean else spent["attention"]
            mlp = spent["mlp_linears"] if lean else spent["mlp_module"]
            rows.append({"attn_proj": spent["attn_proj"], "attn_core": attention - spent["attn_proj"], "mlp": mlp,
                         "lm_head": spent["lm_head"], "other": total - attention - mlp - spent["lm_head"], "total": total})
    finally:
        native.attention_kernel = kernel
        for h in hooks:
            h.remove()
    return {key: statistics.median(r[key] for r in rows[1:]) for key in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", default="1,2,4,5,6,8,9,12,16,24,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="bf16,fp16w,native,native_hf,int8",
                    help="comma list of: bf16, fp32, fp32+oneDNN, fp16w, native, native_ops, native_hf, int8, int8n, int8v, "
                         "int4n, int4v, int4v_ops, gguf, gguf_q8 (all are loaded at once: the 1.5B takes 3-6 GB per 16/32-bit backend)")
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the prefill timed per backend (0: skip)")
    ap.add_argument("--no-roofline", dest="roofline", action="store_false",
                    help="skip measuring bandwidth and peak FLOP/s (about 10 s and 1 GiB of memory)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # a loading bar per backend would bury the table
    ks = [int(k) for k in args.ks.split(",")]
    known = {"bf16": dict(backend="bfloat16"), "fp32": dict(backend="float32"), "fp32+oneDNN": dict(backend="onednn"),
             "fp16w": dict(backend="fp16w"), "native": dict(backend="native"),
             "native_hf": dict(backend="native", lean=False), "native_ops": dict(backend="native", lean="ops"),
             "int8": dict(backend="int8_dynamic"), "int8n": dict(backend="int8_native"), "int8v": dict(backend="int8_vnni"),
             "int4n": dict(backend="int4_native"), "int4v": dict(backend="int4_vnni"),
             "int4v_ops": dict(backend="int4_vnni", lean="ops"), "gguf": dict(backend="gguf"), "gguf_q8": dict(backend="gguf_q8")}
    backends = {b: known[b] for b in args.backends.split(",")}
    print(f"{args.model}, {args.threads} threads, median of {args.repeats}; ms per forward (ratio to k=1)")
    print(f"{'backend':16s} " + " ".join(f"{'k=' + str(k):>14s}" for k in ks))
    components, prefill = {}, {}
    lms = {}
    for name, kwargs in backends.items():  # every backend loaded at once (memory: the sum of their copies)
        kwargs = dict(kwargs)
        lean = kwargs.pop("lean", True)
        lms[name] = load_model(args.model, **kwargs)
        if not lean:  # the native kernels under transformers' own forward: what the lean forward saves
            lms[name].use_forward(None)
        elif lean == "ops":  # the lean forward one Python call per operation: what the two-call layers save
            lms[name].use_forward(LeanDecoder(lms[name].model, fused_layers=False))
        if lms[name].backend.from_gguf_file:  # the file's own bytes per weight (its formats' mix)
            BYTES_PER_WEIGHT[name] = gguf_linear_bytes(lms[name]) / linear_params(lms[name])
            print(f"gguf: the linears hold {gguf_linear_bytes(lms[name]) / 1e9:.3f} GB of the file's blocks "
                  f"({BYTES_PER_WEIGHT[name]:.3f} bytes per weight)")
    first = next(iter(lms.values()))
    params = linear_params(first)
    head = first.model.get_output_embeddings()
    head_params = head.in_features * head.out_features
    all_times, bandwidth = forward_times(lms, ks, args.repeats, probe_gib=1.0 if args.roofline else 0.0)
    for name, times in all_times.items():
        print(f"{name:16s} " + " ".join(f"{1000 * times[k]:7.0f} ({times[k] / times[1]:4.2f})" for k in ks), flush=True)
    for name, lm in lms.items():
        components[name] = {k: component_times(lm, k, args.repeats) for k in (ks[0], ks[-1])}
        if args.prefill:
            prefill[name] = prefill_time(lm, args.prefill, max(1, args.repeats // 2))
    if args.roofline:
        print_roofline(ks, all_times, bandwidth, params, prefill, args.prefill, head_params)
    keys = ["attn_proj", "attn_core", "mlp", "lm_head", "other", "total"]
    print("\nms per forward by component (hooks add some overhead; other = embedding, norms, framework; on the lean"
          " forward (native backends) attn_core is the attention kernel alone and mlp the three linears, RoPE,"
          " the cache write and the activation falling in other)")
    print(f"{'backend':12s} {'k':>3s} " + " ".join(f"{c:>9s}" for c in keys))
    for name, by_k in components.items():
        for k, comp in by_k.items():
            print(f"{name:12s} {k:3d} " + " ".join(f"{1000 * comp[c]:9.1f}" for c in keys))


# bytes each backend streams per linear weight (int8: one byte plus a
# scale per tensor; int8n: per channel; int4n: half a byte plus an fp32 scale per 64 weights)
BYTES_PER_WEIGHT = {"bf16": 2, "fp32": 4, "fp32+oneDNN": 4, "fp16w": 2, "native": 2, "native_ops": 2, "native_hf": 2, "int8": 1, "int8n": 1,
                    "int8v": 1, "int4n": 0.5 + 4 / 64, "int4v": 0.5 + 4 / 64, "int4v_ops": 0.5 + 4 / 64}
LINEARS = " linears"  # a backend's linears-alone row (:func:`linears_pass_s`) is named "<backend> linears"


def bytes_per_weight(row: str) -> float:
    return BYTES_PER_WEIGHT.get(row.removesuffix(LINEARS), 2)


# fp32 arithmetic on the checkpoint's own weights (gguf: on the file's, each exactly the reference's)
EXACT = ("fp32", "fp32+oneDNN", "fp16w", "native", "native_ops", "native_hf", "gguf")


def print_roofline(ks: list[int], all_times: dict[str, dict[int, float]], measured: Bandwidth, params: int,
                   prefill: dict[str, float], prefill_tokens: int, head_params: int) -> None:
    bandwidth = measured.best
    peaks = peak_flops()
    peak = max(peaks.values())
    weight_bytes, flops = 2 * params, 2 * params  # 16-bit weights; a multiply-add per weight and token
    floor = {k: forward_floor_s(k, weight_bytes, flops, bandwidth, peak) for k in ks}
    said = (f"the native streaming read's fastest pass over 1 GiB (prefetching into L1 or L2) {measured.bound / 1e9:.1f} GB/s (the bound), torch's sum "
            f"{measured.torch_sum / 1e9:.1f} GB/s" if measured.bound is not None else
            f"torch's sum over 1 GiB {measured.torch_sum / 1e9:.1f} GB/s (a rate, not a bound: the native probe is unavailable)")
    print(f"\nroofline: read bandwidth {said}, once per repeat between the forwards; peak "
          + ", ".join(f"{name} {f / 1e9:.0f}" for name, f in peaks.items()) + " GFLOP/s")
    print(f"{params / 1e9:.3f} G linear weights: {weight_bytes / 1e9:.2f} GB in 16 bits, {flops / 1e9:.2f} GFLOP per token; "
          f"bandwidth-bound up to k = {weight_bytes / bandwidth * peak / flops:.1f}")
    serial = {k: forward_floor_s(k, weight_bytes, flops, bandwidth, peak, overlap=False) for k in ks}
    print(f"{'floor':16s} " + " ".join(f"{1000 * floor[k]:7.0f} ({floor[k] / floor[1]:4.2f})" for k in ks))
    print(f"{'no overlap':16s} " + " ".join(f"{1000 * serial[k]:7.0f} ({serial[k] / serial[1]:4.2f})" for k in ks)
          + "   (streaming, then arithmetic)")
    print("time / floor (the floor of each backend's own bytes per weight)")
    own_floor = {}
    for name, times in all_times.items():
        own = bytes_per_weight(name)
        own_floor[name] = {k: forward_floor_s(k, own * params, flops, bandwidth, peak) for k in ks}
        print(f"{name:16s} " + " ".join(f"{times[k] / own_floor[name][k]:14.2f}" for k in ks))
    for name, times in all_times.items():
        own = bytes_per_weight(name)
        bound = bandwidth / (own * params)
        share = 100 / times[1] / bound
        print(f"{name}: 1-token forward {1 / times[1]:.2f} tok/s = {share:.0f}% of the probe bound for its "
              f"{own:g}-byte weights ({bound:.2f} tok/s)"
              + (" -- above 100%: the probe is not a bound here (no goal is met on it)" if share > 101 else ""))
    for name in [n for n in all_times if n + LINEARS in all_times]:
        forward, linears = all_times[name], all_times[name + LINEARS]
        print(f"{name}: the forward minus its linears alone (norms, RoPE, attention, joins, framework): "
              + ", ".join(f"k={k} {1000 * (forward[k] - linears[k]):.1f} ms" for k in (ks[0], ks[-1])))
    small = [k for k in ks if k <= 8]
    print(f"goal 1-token >= 90% of the probe bound (exact backends): "
          + ", ".join(f"{n} {100 * own_floor[n][1] / t[1]:.0f}%" for n, t in all_times.items() if n.removesuffix(LINEARS) in EXACT))
    print(f"goal k <= 8 within 1.15x of k = 1: the floor's own worst ratio is {max(floor[k] / floor[1] for k in small):.2f}; "
          + ", ".join(f"{n} {max(t[k] / t[1] for k in small):.2f}" for n, t in all_times.items()))
    if 16 in floor:
        print(f"goal k = 16 <= 1.5x k = 1: the floor's own ratio is {floor[16] / floor[1]:.2f}; "
              + ", ".join(f"{n} {t[16] / t[1]:.2f}" for n, t in all_times.items()))
    print("drafter goal <= 1.3x the bandwidth floor of its own bytes (1 token): "
          + ", ".join(f"{n} {t[1] / own_floor[n][1]:.2f}x" for n, t in all_times.items()))
    for k, goal in ((5, 1.3), (9, 1.6)):
        if k in floor:
            print(f"goal {k}-token <= {goal}x the 1-token forward: the floor's own ratio is {floor[k] / floor[1]:.2f}; "
                  + ", ".join(f"{name} {times[k] / times[1]:.2f}" for name, times in all_times.items()))
    if prefill:  # the LM head runs on the last position only (keep_last=1)
        work = 2 * ((params - head_params) * prefill_tokens + head_params)
        print(f"prefill of {prefill_tokens} tokens (empty cache, {work / 1e9:.0f} GFLOP in the linears): "
              + ", ".join(f"{n} {1000 * t:.0f} ms = {work / t / 1e9:.0f} GFLOP/s ({100 * work / t / peak:.0f}% of the "
                          f"measured fp32 peak)" for n, t in prefill.items()))


if __name__ == "__main__":
    main()
