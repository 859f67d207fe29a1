"""Time the GGUF kernels on a model file's own tensors: ``linear_gguf`` (exact) and, for Q4_K /
Q6_K, ``linear_gguf_q8`` (int8 activations) on this CPU's path and, on an AVX-512 VNNI CPU, its
AVX2 path too (``q8_avx2``: what an AVX2-only CPU runs, the same bits) and the scalar path
(``q8_scalar``: what ran without AVX-512 VNNI before the AVX2 path), at several row counts, the
kernels interleaved in each repeat; prints the best and median time per call and the file bytes
read per second.

    python experiments/gguf_layers.py --model qwen2.5-coder-1.5b --tensors blk.0.ffn_gate.weight,blk.0.ffn_down.weight,output.weight

With ``--every-layer`` each name is a suffix (``ffn_gate.weight``) and one call of each of that
tensor in every layer runs in sequence, as a forward does (a tensor timed alone stays in the
last-level cache between repeats; 28 layers' do not), ``linear_gguf_q8`` on this CPU's path:

    python experiments/gguf_layers.py --every-layer --tensors ffn_gate.weight,ffn_down.weight,attn_q.weight --rows 1,6,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGUFReader

from cascade.models.backends.gguf_weights import FileTensor
from cascade.models.backends.native import native_kernels
from cascade.models.loading import gguf_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a zoo name or a .gguf file")
    ap.add_argument("--tensors", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight,output.weight")
    ap.add_argument("--rows", default=[1, 4, 8], type=lambda s: [int(r) for r in s.split(",")])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every-layer", action="store_true", help="--tensors are suffixes, timed over every layer in sequence")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = native_kernels()
    if ext is None:
        raise SystemExit("cascade's native kernels are unavailable here")
    tensors = {t.name: t for t in GGUFReader(str(gguf_source(args.model))).tensors}
    if args.every_layer:
        every_layer(ext, tensors, args)
        return
    print(f"{args.model}, {args.threads} threads, {args.repeats} repeats (first dropped); ms per call best / median, GB/s of the file's bytes at the best")
    for name in args.tensors.split(","):
        t = FileTensor(tensors[name])
        k, n, blocks = t.k, t.rows, t.data
        kernels = {"exact": ext.linear_gguf}
        if ext.gguf_q8_supported(t.qtype):
            kernels["q8"] = ext.linear_gguf_q8
            if ext.gguf_q8_isa() == "avx512_vnni":
                kernels["q8_avx2"] = lambda *a: ext.linear_gguf_q8(*a, path="avx2")
            if ext.gguf_q8_isa() != "scalar":
                kernels["q8_scalar"] = lambda *a: ext.linear_gguf_q8(*a, path="scalar")
        for m in args.rows:
            x = torch.randn(m, k)
            times = {kind: [] for kind in kernels}
            for _ in range(args.repeats + 1):
                for kind, fn in kernels.items():
                    t0 = time.perf_counter()
                    fn(x, blocks, t.qtype, n)
                    times[kind].append(time.perf_counter() - t0)
            row = "  ".join(f"{kind} {1e3 * min(v[1:]):.3f} / {1e3 * statistics.median(v[1:]):.3f} ms "
                            f"({blocks.numel() / min(v[1:]) / 1e9:.1f} GB/s)" for kind, v in times.items())
            print(f"{name:24s} {t.type_name:5s} {k:5d} x {n:6d}  rows {m:2d}  {row}", flush=True)


def every_layer(ext, tensors: dict, args) -> None:
    print(f"{args.model}, {args.threads} threads, linear_gguf_q8 on path {ext.gguf_q8_isa()}, {args.repeats} repeats; "
          "ms for one call of the tensor in every layer, in sequence: best / median, GB/s of the file's bytes at the best")
    for suffix in args.tensors.split(","):
        layers = [FileTensor(t) for name, t in tensors.items()
                  if (name == suffix or name.endswith("." + suffix)) and ext.gguf_q8_supported(int(t.tensor_type))]
        if not layers:
            raise SystemExit(f"no Q4_K / Q6_K tensor ends with {suffix!r}")
        total = sum(t.data.numel() for t in layers)
        xs = {t.k: torch.randn(max(args.rows), t.k) for t in layers}
        for m in args.rows:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for t in layers:
                    ext.linear_gguf_q8(xs[t.k][:m], t.data, t.qtype, t.rows)
                times.append(time.perf_counter() - t0)
            print(f"{suffix:18s} x {len(layers):2d}  rows {m:2d}  {1e3 * min(times):.2f} / {1e3 * statistics.median(times):.2f} ms "
                  f"({total / min(times) / 1e9:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
