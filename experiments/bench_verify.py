"""Cost of the verifier's acceptance step (cascade.verify) on a chain, at a real vocabulary size.

Chains are verified by the tree rule (a chain is the tree [-1, 0, 1, ...]): one Python-level walk
over the nodes instead of the vectorised chain rule the project had before. This prints what that
costs per step, to compare with a target forward (hundreds of ms for the 1.5B on CPU).

    python experiments/bench_verify.py [--vocab 151936] [--k 8] [--repeats 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from cascade.tree_structure import chain_parents
from cascade.types import DraftBlock, SamplingConfig
from cascade.verify import EXACT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.k + 1, args.vocab, generator=gen) * 3  # [k+1, V]
    draft_logits = logits[:-1] + 0.5 * torch.randn(args.k, args.vocab, generator=gen)
    sampled = SamplingConfig(temperature=1.0)
    q = torch.softmax(draft_logits, -1)  # [k, V]
    tokens = torch.multinomial(q, 1, generator=gen)[:, 0]
    cases = {
        "greedy": (DraftBlock(logits[:-1].argmax(-1), None, parents=chain_parents(args.k)), SamplingConfig()),
        "sampled, q": (DraftBlock(tokens, q), sampled),
        "sampled, one-hot q": (DraftBlock(tokens, None), sampled),
    }
    for name, (block, cfg) in cases.items():
        EXACT.accept(block, logits, cfg, gen)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            EXACT.accept(block, logits, cfg, gen)
        ms = (time.perf_counter() - t0) / args.repeats * 1e3
        print(f"{name:20s} k={args.k} V={args.vocab}: {ms:.3f} ms per step (incl. softmax of the target's k+1 rows)")


if __name__ == "__main__":
    main()
