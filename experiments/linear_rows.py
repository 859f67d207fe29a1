"""The native fp16-weight linear on a model's layer shapes, weights streamed from memory, for
1-32 rows: what one call over every linear of the model costs at each row count, and variants of
the kernel's two tuning constants built side by side (interleaved per repeat in one process).

Each variant is the extension's source compiled with ``-DCASCADE_PREFETCH_BYTES=...`` (how far
ahead along a panel's stream the kernel prefetches) and ``-DCASCADE_FP16_ROWS=...`` (rows per
register block on AVX-512), into its own directory under ``$CASCADE_CACHE/native-variants/``.
The weights are random with the model's shapes (every layer distinct, so nothing stays in
cache); every variant's output is checked bitwise against the first's (they differ only in the
order of memory accesses and the blocking of rows, never in any output's arithmetic).

    python experiments/linear_rows.py --model qwen2.5-coder-1.5b \\
        --variants 1024:8,8192:8,8192:12 --rows 1,2,4,6,8,9,12,16 --repeats 5

Prints ms per pass over all layers, the GB/s of weight streamed and the ratio to the first row
count, then the fastest variant's read rate at the first row count and its GFLOP/s at the last
(the two halves of the roofline: a call costs at least the larger of streaming and arithmetic).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cascade.models import zoo  # noqa: E402
from cascade.models.backends.native import SOURCES, build_extension, pack_fp16  # noqa: E402


def build_variant(prefetch_bytes: int, rows: int):
    name = f"cascade_native_pf{prefetch_bytes}_r{rows}"
    return build_extension(name, SOURCES, zoo.cache_root() / "native-variants" / name,
                           (f"-DCASCADE_PREFETCH_BYTES={prefetch_bytes}", f"-DCASCADE_FP16_ROWS={rows}"))


def layer_shapes(model: str) -> tuple[list[tuple[int, int]], int]:
    """[(out, in)] of one decoder layer's linears, and the number of layers, from the config."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(zoo.fetch(model))
    h, inter, heads, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    return [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (inter, h), (inter, h), (h, inter)], cfg.num_hidden_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--variants", default="1024:8,8192:8,8192:12", help="PREFETCH_BYTES:ROWS, comma separated")
    ap.add_argument("--rows", default="1,2,4,6,8,9,12,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = []
    for spec in args.variants.split(","):
        pf, rows = (int(v) for v in spec.split(":"))
        print(f"building prefetch {pf} B, {rows} rows per block ...", flush=True)
        variants.append((f"pf{pf}/r{rows}", build_variant(pf, rows)))
    ms = [int(m) for m in args.rows.split(",")]
    shapes, n_layers = layer_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    layers = [[(pack_fp16(torch.randn(n, k, generator=gen) * 0.02), n, k) for n, k in shapes] for _ in range(n_layers)]
    weights = sum(n * k for n, k in shapes) * n_layers
    inputs = {m: {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}} for m in ms}
    times: dict[tuple[str, int], list[float]] = {(name, m): [] for name, _ in variants for m in ms}
    for rep in range(args.repeats):
        for m in ms:
            outputs = []
            for name, ext in variants:
                start = time.perf_counter()
                for layer in layers:
                    for packed, n, k in layer:
                        ext.linear_fp16(inputs[m][k], packed, n, None)
                times[(name, m)].append(time.perf_counter() - start)
                packed, n, k = layers[0][-1]
                outputs.append(ext.linear_fp16(inputs[m][k], packed, n, None))
            for (name, _), y in zip(variants, outputs):
                if not torch.equal(y, outputs[0]):
                    raise SystemExit(f"{name} differs from {variants[0][0]} at {m} rows: not the same arithmetic")
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    print(f"\n{args.model}: {n_layers} layers x {len(shapes)} linears, {weights / 1e9:.3f} G fp16 weights "
          f"({2 * weights / 1e9:.2f} GB), {args.threads} threads, median of {args.repeats}; "
          "ms per pass (GB/s of weight, ratio to the first row count)")
    print(f"{'rows':<6}" + "".join(f"{name:>24}" for name, _ in variants))
    base = {name: statistics.median(times[(name, ms[0])]) for name, _ in variants}
    for m in ms:
        cells = []
        for name, _ in variants:
            t = statistics.median(times[(name, m)])
            cells.append(f"{t * 1e3:8.1f} {2 * weights / t / 1e9:4.0f} ({t / base[name]:.2f})")
        print(f"{m:<6}" + "".join(f"{c:>24}" for c in cells))
    best = min(statistics.median(times[(name, ms[0])]) for name, _ in variants)
    fastest_rows = max(ms)
    flops = min(statistics.median(times[(name, fastest_rows)]) for name, _ in variants)
    print(f"\nfastest pass at {ms[0]} rows {best * 1e3:.1f} ms = {2 * weights / best / 1e9:.0f} GB/s of weight; "
          f"at {fastest_rows} rows {2 * weights * fastest_rows / flops / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
