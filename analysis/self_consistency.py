"""Does another program's speculative decoding reproduce its own autoregressive output?

A run's divergences (``MethodSummary.divergences``) compare every method with cascade's
autoregressive baseline; a peer program's methods (llama.cpp: ``llamacpp:<type>``; transformers'
generate: ``transformers_generate:<helper>``) run other arithmetic, so they differ from it for
reasons of their own. This compares each speculative method of a peer with that peer's own
autoregressive method of the same run, prompt by prompt (greedy: a lossless implementation
matches it on every prompt; a batched verification that is not row-invariant may not).

    python -m analysis.self_consistency RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis.summaries import each_run


@dataclass(frozen=True)
class SelfConsistency:
    method: str
    baseline: str  # the same program's autoregressive method
    differing: list[tuple[str, int]]  # (prompt id, first differing position)
    prompts: int


def first_difference(a: list[int], b: list[int]) -> int | None:
    j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if j is None and len(a) != len(b) else j


def self_consistency(summary: dict) -> list[SelfConsistency]:
    """Each peer method (a drafter kind ``program:type``) against its program's ``:ar`` method."""
    methods = summary["methods"]
    kinds = {name: m["drafter"]["kind"] for name, m in methods.items()}
    out = []
    for name, kind in kinds.items():
        program, _, helper = kind.partition(":")
        if not helper or helper == "ar" or program in ("autoregressive",):
            continue
        baseline = next((b for b, k in kinds.items() if k == f"{program}:ar"), None)
        if baseline is None:
            continue
        ar, toks = methods[baseline]["tokens"], methods[name]["tokens"]
        differing = [(pid, j) for pid in ar if (j := first_difference(ar[pid], toks[pid])) is not None]
        out.append(SelfConsistency(name, baseline, differing, len(ar)))
    return out


def main() -> None:
    for run, summary in each_run(__doc__):
        for row in self_consistency(summary):
            where = ", ".join(f"{pid} at {j}" for pid, j in row.differing) or "none"
            print(f"{run.name}: {row.method} vs {row.baseline}: {row.prompts - len(row.differing)}/{row.prompts} prompts "
                  f"identical; first differences: {where}")


if __name__ == "__main__":
    main()
