"""A model's native linear layers against the same kernels at another git revision: the model
loaded once in one format (``--quantize``: a drafter's int4 / int8 kernels, or ``none`` for
the exact fp16 one), every linear layer (the LM head included) made an op of each revision's
extension over the same packed tensors, and one pass over all of them timed per revision,
interleaved per repeat in one process (weights streamed from memory: the model does not fit in
cache). Every layer's output is checked bitwise between the two (a change of access order or
prefetching must not change one bit).

    python experiments/linear_revision.py --rev 58d5cbd --quantize int4_vnni --rows 1,4

Prints ms per pass, the GB/s of packed weight and scales read, and the ratio old / new.
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

from cascade.models import load_model, native  # noqa: E402
from experiments.attention_kernel import build_revision  # noqa: E402


def model_linears(lm) -> list[native.NativeLinear]:
    """Every native linear layer of ``lm`` in forward order, the LM head last."""
    layers = [m for m in lm.model.model.modules() if isinstance(m, native.NativeLinear)]
    head = lm.model.get_output_embeddings()
    return layers + ([head] if isinstance(head, native.NativeLinear) else [])


def panel_bytes(linear: native.NativeLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (getattr(linear, a) for a in linear.PANEL_TENSORS.values()))


def ops_of(ext, linears: list[native.NativeLinear]) -> list:
    """The layers as ``ext``'s LinearOps, over the layers' own tensors."""
    return [ext.LinearOp(**m.op_fields()) for m in linears]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree's kernels with")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--quantize", default="int4_vnni", help="cascade.models.backends.quantize method, or none (native fp16)")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {"dtype": "native"} if args.quantize == "none" else {"quantize": args.quantize}
    lm = load_model(args.model, **kwargs)
    linears = model_linears(lm)
    if not linears:
        raise SystemExit(f"{args.model} with {kwargs} has no native linear layers")
    commit, old = build_revision(args.rev)
    revisions = {commit: ops_of(old, linears), "working tree": ops_of(native.native_kernels(), linears)}
    nbytes = sum(panel_bytes(m) for m in linears)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model} ({args.quantize}): {len(linears)} linear layers, {nbytes / 1e6:.0f} MB packed, "
          f"{args.threads} threads, median of {args.repeats}; ms per pass over all (GB/s)")
    print(f"{'rows':<6}{commit:>16}{'working tree':>16}{'old / new':>11}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, m.in_features, generator=gen) for m in linears]
        for (op_old, op_new, x) in zip(*revisions.values(), inputs):
            if not torch.equal(op_old(x), op_new(x)):
                raise SystemExit(f"the two revisions differ at {rows} rows: not the same arithmetic")
        times: dict[str, list[float]] = {name: [] for name in revisions}
        for _ in range(args.repeats):
            for name, ops in revisions.items():
                start = time.perf_counter()
                for op, x in zip(ops, inputs):
                    op(x)
                times[name].append(time.perf_counter() - start)
        t_old, t_new = (statistics.median(times[name]) for name in revisions)
        cells = [f"{1e3 * t:8.2f} ({nbytes / t / 1e9:4.1f})" for t in (t_old, t_new)]
        print(f"{rows:<6}{cells[0]:>16}{cells[1]:>16}{t_old / t_new:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
