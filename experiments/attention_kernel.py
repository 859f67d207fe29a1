"""The native attention over the cache against the same kernel at another git revision: both
built side by side, interleaved per repeat in one process, on a model's attention shapes (its
query and key/value heads and head size, every layer, a 200-token cache) for 1-16 queries.
Each revision's output is compared with the other's (they may differ in the last bits: the
order of the sums is each kernel's own).

    python experiments/attention_kernel.py --rev b746951 --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cascade.models import zoo  # noqa: E402
from cascade.models.backends.native import CSRC, build_extension, native_kernels  # noqa: E402


def build_revision(rev: str):
    """The extension as it was at ``rev``: every file of the kernels' directory at that revision."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", rev).strip()
    build = zoo.cache_root() / "native-variants" / f"rev-{commit}"
    build.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in git("ls-tree", "--name-only", f"{rev}:{CSRC.relative_to(ROOT)}").split():
        (build / name).write_text(git("show", f"{rev}:{CSRC.relative_to(ROOT)}/{name}"))
        if name.endswith(".cpp"):
            sources.append(build / name)
    return commit, build_extension(f"cascade_native_rev_{commit}", sources, build)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree's kernel with")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--queries", default="1,4,8,16")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(zoo.fetch(args.model))
    heads, kv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    commit, old = build_revision(args.rev)
    new = native_kernels()
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: {layers} layers, {heads} query heads, {kv} key/value heads, D = {d}, {args.past}-token cache, "
          f"{args.threads} threads, median of {args.repeats}; ms for all layers")
    print(f"{'queries':<8}{commit:>12}{'working tree':>14}{'ratio':>8}{'max |diff|':>12}")
    for n in (int(v) for v in args.queries.split(",")):
        q = torch.randn(1, heads, n, d, generator=gen)
        k = torch.randn(1, kv, args.past + n, d, generator=gen)
        v = torch.randn(1, kv, args.past + n, d, generator=gen)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for name, ext in (("old", old), ("new", new)):
                start = time.perf_counter()
                for _ in range(layers):
                    ext.attention(q, k, v, None, d ** -0.5)
                times[name].append(time.perf_counter() - start)
        diff = (old.attention(q, k, v, None, d ** -0.5) - new.attention(q, k, v, None, d ** -0.5)).abs().max().item()
        t_old, t_new = (statistics.median(times[name]) * 1e3 for name in ("old", "new"))
        print(f"{n:<8}{t_old:>12.2f}{t_new:>14.2f}{t_old / t_new:>7.2f}x{diff:>12.1e}")


if __name__ == "__main__":
    main()
