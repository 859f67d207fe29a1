"""How fast this machine reads memory, by five probes over 1 GiB (far past any cache), on the
threads torch is set to use: cascade's streaming read at the kernels' prefetch distance (the
fastest pass: the bound ``forward_cost.py``'s roofline divides by), a sum of fp32, a sum of
fp16, a copy of fp32 (bytes read and written both counted), and FBGEMM's fp16-weight GEMM on one
row over a 1 GiB weight (the kernel ``backend="fp16w"`` runs for a one-token forward); and the
bound each implies for a model's 16-bit weights.

    python experiments/bandwidth.py --model-gb 3.09      # the 1.5B's linear weights in 16 bits
"""

from __future__ import annotations

import argparse

import torch

from cascade.timing import median_s, read_bandwidth


def probes(repeats: int = 5) -> dict[str, float]:
    """Bytes per second of each probe."""
    measured = read_bandwidth(1.0, repeats)
    out = {"sum fp32": measured.torch_sum}
    if measured.bound is not None:
        out = {"native streaming read (fastest pass: the bound)": measured.bound, **out}
    x = torch.ones(1 << 28)  # 1 GiB fp32
    y = torch.empty_like(x)
    out["copy fp32 (read + write)"] = 2 * x.numel() * 4 / median_s(lambda: y.copy_(x), repeats)
    del x, y
    h = torch.ones(1 << 29, dtype=torch.float16)  # 1 GiB fp16
    out["sum fp16"] = h.numel() * 2 / median_s(lambda: h.sum(), repeats)
    del h
    if "fbgemm" in torch.backends.quantized.supported_engines:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(32768, 16384) * 0.02, None)  # 1 GiB in fp16
        v = torch.randn(1, 16384)
        out["FBGEMM fp16w, 1 row"] = 32768 * 16384 * 2 / median_s(lambda: torch.ops.quantized.linear_dynamic_fp16(v, packed), repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-gb", type=float, default=3.09, help="weight bytes one token streams, in GB")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, median of {args.repeats}")
    for name, rate in probes(args.repeats).items():
        print(f"{name:26s} {rate / 1e9:6.1f} GB/s -> {args.model_gb} GB per token: {1000 * args.model_gb * 1e9 / rate:5.0f} ms "
              f"({rate / (args.model_gb * 1e9):5.2f} tok/s)")


if __name__ == "__main__":
    main()
