"""A run's methods as the markdown table docs/results.md shows, from its ``summary.json``:
τ, α (trees: accepted path / drafted nodes), nodes drafted per step, c (drafter time per drafted
token over a verification forward), decode-only and whole-call speedups over the run's
baseline, the whole-call speedup's range over prompts, and how many greedy outputs equal the
baseline's. With ``--by-category`` (the mixed set): the speedup per category instead. With ``--without
PROMPT`` (repeatable): each method's overall whole-call and decode-only speedups over the
remaining prompts (whole calls from the per-prompt tok/s, decoding from ``steps.jsonl``), for a
prompt a disturbance distorted.

    python -m analysis.markdown RUN_DIR [--by-category] [--without PROMPT ...] [--caption] [--pair OTHER_RUN_DIR]

``--caption`` first prints what made the table (command, commit, CPU, backends), from the run.
``--pair OTHER_RUN_DIR``: two runs of the same command side by side (τ, nodes per step,
decode-only and whole-call speedups of each).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ratio_range(method: dict, baseline: dict) -> str:
    mine, base = method.get("tokens_per_s_by_prompt") or {}, baseline.get("tokens_per_s_by_prompt") or {}
    ratios = [mine[p] / base[p] for p in mine if p in base and base[p]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def _first(values: dict) -> float | None:
    return next(iter(values.values()), None) if values else None


def _decode(method: dict) -> str:
    """The decode-only speedup; "-" for a method that recorded no prefill time (transformers'
    ``generate`` has no prefill to exclude, so its ratio would not be one; llama.cpp reports
    its prompt time, so its decode is comparable)."""
    if method.get("decode_speedup") is None or not method["stats"].get("prefill_time_s"):
        return "-"
    return f"{method['decode_speedup']:.2f}x"


def _tau(method: dict) -> str:
    tau = method["stats"].get("tau")  # (None for a generate: method: it records no rounds)
    return "-" if tau is None else f"{tau:.2f}"


def method_row(name: str, method: dict, baseline: dict, prompts: int) -> list[str]:
    st = method["stats"]
    tree = st.get("tree_acceptance") is not None
    alpha = st.get("tree_acceptance") if tree else st.get("alpha")
    c = _first(st.get("c_by_drafter") or {})
    nodes = st.get("tree_nodes_per_step") if tree else st.get("drafted_per_step")
    is_base = method is baseline
    return [name, _tau(method), "-" if alpha is None else ("tree " if tree else "") + f"{alpha:.3f}",
            "-" if not nodes else f"{nodes:.1f}", "-" if c is None else f"{c:.3f}", _decode(method),
            f"{method['speedup']:.2f}x", "-" if is_base else _ratio_range(method, baseline),
            f"{method.get('identical_to_baseline', 0)}/{prompts}"]


def table(summary: dict) -> str:
    methods, base_name = summary["methods"], summary["baseline"]
    baseline = methods[base_name]
    prompts = len(baseline.get("tokens") or {})
    head = ["method", "τ", "α", "nodes/step", "c", "decode", "speedup", "range", "same"]
    rows = [method_row(n, m, baseline, prompts) for n, m in methods.items()]
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def category_table(summary: dict) -> str:
    methods = summary["methods"]
    cats = list((methods[summary["baseline"]].get("by_category") or {}).keys())
    if not cats:
        raise SystemExit("this run has no per-category records (not the mixed set)")
    head = ["method", *cats, "overall", "decode", "τ"]
    rows = []
    for name, m in methods.items():
        by = m.get("by_category") or {}
        rows.append([name, *(f"{by[c]['speedup']:.2f}" if c in by else "-" for c in cats), f"{m['speedup']:.2f}x",
                     _decode(m), _tau(m)])
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def without_table(run_dir: Path, summary: dict, skip: set[str]) -> str:
    """Overall speedups of every method over the prompts not in ``skip``."""
    methods, base = summary["methods"], summary["baseline"]
    unknown = skip - set(methods[base].get("tokens_per_s_by_prompt") or {})
    if unknown:
        raise SystemExit(f"no such prompts in this run: {sorted(unknown)}")

    def whole(m: dict) -> float:  # tokens / seconds over the kept prompts
        rates = m["tokens_per_s_by_prompt"]
        kept = [p for p in rates if p not in skip]
        return sum(len(m["tokens"][p]) for p in kept) / sum(len(m["tokens"][p]) / rates[p] for p in kept)

    emitted: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["prompt"] not in skip:
            emitted[r["method"]] = emitted.get(r["method"], 0.0) + r["emitted"]
            seconds[r["method"]] = seconds.get(r["method"], 0.0) + r["step_time_s"]
    head = ["method", "speedup", "decode"]
    rows = []
    for name, m in methods.items():
        decode = "-" if name not in seconds else f"{(emitted[name] / seconds[name]) / (emitted[base] / seconds[base]):.2f}x"
        rows.append([name, f"{whole(m) / whole(methods[base]):.2f}x", decode])
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def pair_table(first: dict, second: dict) -> str:
    """Two runs of the same command side by side (docs/results.md's "a / b" tables): τ and nodes
    per step of each, decode-only and whole-call speedups of each, greedy outputs equal to the
    baseline's in each."""
    head = ["method", "τ (a / b)", "nodes/step (a / b)", "decode a", "decode b", "whole a", "whole b", "same"]
    rows = []
    for name, a in first["methods"].items():
        b = second["methods"].get(name)
        if b is None:
            continue
        nodes = [m["stats"].get("tree_nodes_per_step") or m["stats"].get("drafted_per_step") or 0.0 for m in (a, b)]
        prompts = [len(run["methods"][run["baseline"]].get("tokens") or {}) for run in (first, second)]
        rows.append([name, f"{_tau(a)} / {_tau(b)}", f"{nodes[0]:.1f} / {nodes[1]:.1f}", _decode(a), _decode(b),
                     f"{a['speedup']:.2f}x", f"{b['speedup']:.2f}x",
                     f"{a.get('identical_to_baseline', 0)}/{prompts[0]}, {b.get('identical_to_baseline', 0)}/{prompts[1]}"])
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def caption(run_dir: Path, summary: dict) -> str:
    """What made the table, from the run itself: the command (its Hydra overrides), the commit and
    whether the code was clean, the CPU, the backends and threads (the summary's environment)."""
    env = summary.get("environment") or {}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    args = [line[2:].strip() for line in overrides.read_text().splitlines() if line.startswith("- ")] if overrides.is_file() else []
    commit = (env.get("git_commit") or "no commit")[:7]
    state = {True: "DIRTY", False: "clean"}.get(env.get("git_dirty"), "cleanliness not recorded")
    backends = ", ".join(f"{k} {v}" for k, v in (env.get("backends") or {}).items()) or f"target dtype {env.get('dtype')}"
    return (f"`python -m cascade.run {' '.join(args)}` at `{commit}` ({state}); {env.get('cpu')} (family "
            f"{env.get('cpu_family')} model {env.get('cpu_model')}), {env.get('threads')} threads; {backends}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--by-category", action="store_true", help="speedup per category (the mixed set)")
    ap.add_argument("--without", action="append", default=[], metavar="PROMPT",
                    help="overall speedups without this prompt (repeatable)")
    ap.add_argument("--caption", action="store_true", help="first a line naming the command, commit, CPU and backends")
    ap.add_argument("--pair", metavar="OTHER_RUN_DIR", help="a second run of the same command, side by side (a / b)")
    args = ap.parse_args(argv)
    path = Path(args.run_dir) / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass a run directory of python -m cascade.run")
    summary = json.loads(path.read_text())
    other = json.loads((Path(args.pair) / "summary.json").read_text()) if args.pair else None
    if args.caption:
        print(("a: " if other else "") + caption(Path(args.run_dir), summary) + "\n")
        if other:
            print("b: " + caption(Path(args.pair), other) + "\n")
    if other:
        print(pair_table(summary, other))
    elif args.without:
        print(without_table(Path(args.run_dir), summary, set(args.without)))
    else:
        print(category_table(summary) if args.by_category else table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
