"""The lean forward's decoder as one native call (``decoder_step``) against the same layers
called one by one from Python (``layer_step`` per layer), interleaved per repeat in one process
on a 200-token cache: what the interpreter's work per layer costs a forward. The logits are
bitwise the same either way (tests/test_native.py).

    python experiments/decoder_call.py --model qwen2.5-coder-0.5b --formats int4_vnni,native
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cascade.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--formats", default="int4_vnni,native", help="comma list: native (fp16 weights) or a quantize= format")
    ap.add_argument("--ks", default="1,4", help="tokens per forward")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.threads} threads, 200-token cache, median of {args.repeats}; ms per forward")
    print(f"{'format':12s} {'k':>3s} {'one call':>9s} {'per layer':>10s} {'ratio':>6s}")
    for fmt in args.formats.split(","):
        lm = load_model(args.model, backend="native") if fmt == "native" else load_model(args.model, backend=fmt)
        lean = lm.lean
        if lean is None or lean.decoder is None:
            raise SystemExit(f"{fmt}: the lean forward does not run {args.model} as one call")
        one_call = lean.decoder
        cache = lm.new_cache()
        lm.forward(list(range(100, 300)), cache)

        def forward(decoder, k: int) -> float:
            lean.decoder = decoder  # None: layer by layer
            start = time.perf_counter()
            lm.forward(list(range(5, 5 + k)), cache)
            elapsed = time.perf_counter() - start
            lm.crop(cache, 200)
            return elapsed

        for k in (int(x) for x in args.ks.split(",")):
            times: dict[str, list[float]] = {"one": [], "layers": []}
            for _ in range(5):
                forward(one_call, k), forward(None, k)
            for _ in range(args.repeats):
                times["one"].append(forward(one_call, k))
                times["layers"].append(forward(None, k))
            one, layers = (statistics.median(times[x]) * 1e3 for x in ("one", "layers"))
            print(f"{fmt:12s} {k:3d} {one:9.2f} {layers:10.2f} {layers / one:6.3f}")
        lean.decoder = one_call


if __name__ == "__main__":
    main()
