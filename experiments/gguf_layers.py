"""Time the GGUF kernels on a model file's own tensors: ``linear_gguf`` (exact) and, for Q4_K /
Q6_K, ``linear_gguf_q8`` (int8 activations) on this CPU's path and, on an AVX-512 VNNI CPU, its
AVX2 path too (``q8_avx2``: what an AVX2-only CPU runs, the same bits) and the scalar path
(``q8_scalar``: what ran without AVX-512 VNNI before the AVX2 path), at several row counts, the
kernels interleaved in each repeat; prints the best and median time per call and the file bytes
read per second.

    python experiments/gguf_layers.py --model qwen2.5-coder-1.5b --tensors blk.0.ffn_gate.weight,blk.0.ffn_down.weight,output.weight
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGUFReader

from cascade.models.loading import gguf_source
from cascade.models.backends.native import native_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a zoo name or a .gguf file")
    ap.add_argument("--tensors", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight,output.weight")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = native_kernels()
    if ext is None:
        raise SystemExit("cascade's native kernels are unavailable here")
    tensors = {t.name: t for t in GGUFReader(str(gguf_source(args.model))).tensors}
    print(f"{args.model}, {args.threads} threads, {args.repeats} repeats (first dropped); ms per call best / median, GB/s of the file's bytes at the best")
    for name in args.tensors.split(","):
        t = tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        blocks = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8).reshape(n, -1)
        kernels = {"exact": ext.linear_gguf}
        if ext.gguf_q8_supported(int(t.tensor_type)):
            kernels["q8"] = ext.linear_gguf_q8
            if ext.gguf_q8_isa() == "avx512_vnni":
                kernels["q8_avx2"] = lambda *a: ext.linear_gguf_q8(*a, path="avx2")
            if ext.gguf_q8_isa() != "scalar":
                kernels["q8_scalar"] = lambda *a: ext.linear_gguf_q8(*a, path="scalar")
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            times = {kind: [] for kind in kernels}
            for _ in range(args.repeats + 1):
                for kind, fn in kernels.items():
                    t0 = time.perf_counter()
                    fn(x, blocks, int(t.tensor_type), n)
                    times[kind].append(time.perf_counter() - t0)
            row = "  ".join(f"{kind} {1e3 * min(v[1:]):.3f} / {1e3 * statistics.median(v[1:]):.3f} ms "
                            f"({blocks.numel() / min(v[1:]) / 1e9:.1f} GB/s)" for kind, v in times.items())
            print(f"{name:24s} {t.tensor_type.name:5s} {k:5d} x {n:6d}  rows {m:2d}  {row}", flush=True)


if __name__ == "__main__":
    main()
