"""Power of the deep losslessness test: how often it fails each subtly broken double
(tests/broken_doubles.py), and how often it fails the exact code (false alarms), over many seeds
at the sample size CI uses (test_lossless_deep.N_FAST generations per test).

    python tests/power_table.py --seeds 20 --jobs 2

Prints one row per (double, method): failures / seeds at the test's level, and the median
p-value. ``exact``, ``block`` and ``traversal`` rows run the real code (false alarms). Each seed is a different generator seed for the same models and reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from broken_doubles import VERIFIERS, FullQPrunedDrafter, MiddleResidualCascade  # noqa: E402
from cascade.drafters import SmallLMDrafter  # noqa: E402
from deep_stats import LEVEL  # noqa: E402
import test_lossless_deep as deep  # noqa: E402
from cascade.verify import VERIFIERS as RULES  # noqa: E402

CASES = [
    ("exact", "chain_small_lm"),
    ("exact", "static_tree"),
    ("exact", "vertical_2"),
    ("exact", "far_chain"),
    ("exact", "static_tree_kangaroo"),
    ("exact", "reranked_tree"),
    ("exact", "dynamic_tree"),
    ("residual_eps", "far_chain"),
    ("bonus_wrong_row", "chain_small_lm"),
    ("q_wrong_position", "chain_small_lm"),
    ("mask_off_by_one", "static_tree"),
    ("middle_residual", "vertical_2"),
    ("exact", "tree_recycling"),
    ("exact", "chain_suffix"),
    ("exact", "vertical_recycling"),
    ("sibling_vs_p", "tree_recycling"),
    ("exact", "chain_pruned_head"),
    ("full_q_pruned", "chain_pruned_head"),
    # block and traversal verification (cascade.verify): the rules themselves, then a double of each
    ("block", "chain_small_lm"),
    ("traversal", "static_tree"),
    ("block_weight_shift", "chain_small_lm"),
    ("traversal_stale", "static_tree"),
    # doubles visible only under warping, tree-sibling and commit doubles (each at the method and
    # setting test_lossless_deep.WARPED_AND_TREE_DOUBLES names), and the exact code there
    ("exact", "chain_small_lm/cold"),
    ("exact", "chain_small_lm/top_k"),
    ("exact", "chain_small_lm/top_p"),
    *[(d, "/".join(ms)) for d, ms in deep.WARPED_AND_TREE_DOUBLES.items()],
    # cross-tokenizer drafting (tests/test_cross_tokenizer.py's char-BPE pair, its N and law)
    ("exact", "cross/chain_intersection"),
    ("unrenormalised_intersection", "cross/chain_intersection"),
]
_cross_pair = None


def _cross_pvalue(double: str, method: str, seed: int) -> float:
    """A cross-tokenizer cell at test_cross_tokenizer's sample size: the exact drafter or the
    unrenormalised-intersection double, under temperature 1."""
    global _cross_pair
    import test_cross_tokenizer as cross
    from broken_doubles import UnrenormalisedIntersectionDrafter

    if _cross_pair is None:
        _cross_pair = cross.build_char_pair()
    target, drafter_lm, close = _cross_pair
    name = method.split("/", 1)[1]
    make = (lambda: UnrenormalisedIntersectionDrafter(drafter_lm, k=5)) if double != "exact" \
        else cross._deep_methods(drafter_lm, close)[name][0]
    _, p = cross._pvalue(target, make, "temperature", seed=1000 + seed)
    return p
_models = None


def _pvalue(job: tuple[str, str, int, int]) -> tuple[str, str, int, float]:
    global _models
    double, method, seed, n = job
    if method.startswith("cross/"):
        return double, method, seed, _cross_pvalue(double, method, seed)
    if _models is None:
        target = deep.damped()
        _models = (target, deep.perturbed_copy(target, 0.35, seed=3), deep.perturbed_copy(target, 0.6, seed=4))
    target, close, far = _models
    if double in deep.WARPED_AND_TREE_DOUBLES:
        _, p = deep._broken(_models, double, n, seed=1000 + seed)
        return double, method, seed, p
    if "/" in method:  # the exact code at a method/setting
        run_as, setting = method.split("/")
        _, p = deep._check(_models, run_as, setting, n, seed=1000 + seed)
        return double, method, seed, p
    drafter = None
    run_as = method
    if method == "far_chain":  # the small-LM chain with the far drafter (rejections at depth 1: ~50%)
        drafter = lambda: SmallLMDrafter(far, k=5)  # noqa: E731
        run_as = "chain_small_lm"
    elif double == "middle_residual":
        drafter = lambda: MiddleResidualCascade([SmallLMDrafter(close, k=5), SmallLMDrafter(far, k=2)])  # noqa: E731
    elif double == "full_q_pruned":
        drafter = lambda: FullQPrunedDrafter(deep.prune_head(close, deep.torch.tensor([0, 1, 2, 4])), close, k=5)  # noqa: E731
    _, p = deep._check(_models, run_as, "temperature", n, seed=1000 + seed, verifier=VERIFIERS.get(double) or RULES.get(double), drafter=drafter)
    return double, method, seed, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--n", type=int, default=deep.N_FAST, help="generations per test (CI: N_FAST)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", choices=["exact", "broken"], help="only the exact code, or only the broken doubles")
    ap.add_argument("--methods", default="", help="comma-separated subset of methods (default: every case)")
    ap.add_argument("--doubles", default="", help="comma-separated subset of doubles ('exact' included; default: every case)")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only is None or (c[0] == "exact") == (args.only == "exact")]
    if args.methods:
        cases = [c for c in cases if c[1] in args.methods.split(",")]
    if args.doubles:
        cases = [c for c in cases if c[0] in args.doubles.split(",")]
    jobs = [(d, m, s, args.n) for d, m in cases for s in range(args.seeds)]
    with Pool(args.jobs) as pool:
        results = pool.map(_pvalue, jobs, chunksize=1)
    print(f"{args.seeds} seeds, {args.n} generations of {deep.L} tokens per test, level {LEVEL}")
    print(f"{'double':18s} {'method':26s} {'failed':>8s} {'median p':>10s}")
    for d, m in cases:
        ps = [p for dd, mm, _, p in results if (dd, mm) == (d, m)]
        fails = sum(p < LEVEL for p in ps)
        print(f"{d:18s} {m:26s} {fails:>4d}/{len(ps):<3d} {statistics.median(ps):10.2g}")


if __name__ == "__main__":
    main()
