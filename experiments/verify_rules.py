"""The same drafts judged by every verification rule: exact expected accepted tokens, paired.

``paired``: decodes the token-wise methods of ``+experiment=bench/verify`` (or of
``--experiment``, e.g. ``bench/verify_trees``: a static tree with sampled siblings), so the drafts
are what the methods really propose under sampling, and at every step computes for that very draft each
rule's exact expected number of accepted tokens from the same p and q
(``cascade.verify.expected_accepted``: token-wise, and block on a chain / traversal on a tree).
Per method it prints the mean expected τ (1 + accepted) under each rule, their ratio, and the
ratio's range over prompts: a comparison free of the sampling noise that separate runs carry.

``report RUN_DIR ...``: per method of bench/verify runs: τ, speedup, and the acceptance rule's
own time per step (``StepRecord.accept_time_s``) next to the target forward's.

    python experiments/verify_rules.py paired [--experiment bench/verify_trees] [--out FILE.json] [Hydra overrides, e.g. dataset=gsm8k sampling.temperature=1.0]
    python experiments/verify_rules.py report results/bench/verify/*/
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from tqdm.auto import tqdm

from cascade.data import encode, load_prompts
from cascade.decode import generate
from cascade.metrics import write_json_atomic
from cascade.models import load_model
from cascade.results import load_jobs
from cascade.run import build_method, method_configs, validate, verify_rule
from cascade.tree_structure import is_chain
from cascade.verify import Verifier, accept_sampled, expected_accepted

CONF = str(Path(__file__).resolve().parents[1] / "conf")


class PairedRecorder:
    """A token-wise sampled rule that also records, per draft, every rule's exact expectation."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.prompt = ""

    def __call__(self, tokens, parents, q, p, generator):
        if tokens:
            other = "block" if is_chain(parents) else "traversal"
            self.rows.append({"prompt": self.prompt, "nodes": len(tokens), "other": other,
                              "token": expected_accepted("token", tokens, parents, q, p),
                              "rule": expected_accepted(other, tokens, parents, q, p)})
        return accept_sampled(tokens, parents, q, p, generator)


def paired(args, overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={args.experiment}", *overrides])
    sampling = validate(cfg)
    if sampling.greedy:
        raise SystemExit("every rule is the greedy one under greedy decoding: pass a sampling setting")
    torch.set_num_threads(cfg.threads)
    ds, m = cfg.dataset, cfg.models
    prompt_set = load_prompts(ds.name, ds.num_prompts, ds.path, ds.field, ds.get("per_category", 3))
    target = load_model(m.target, m.backend, m.device)
    prompts = [encode(target, p, ds.chat_template) for p in prompt_set]
    chosen = {n: c for n, c in method_configs(cfg).items() if c.get("drafter") is not None and verify_rule(cfg, c) == "token"}
    recorders = {n: PairedRecorder() for n in chosen}
    drafters = {n: build_method(c).drafter for n, c in chosen.items()}
    for i, (spec, ids) in enumerate(tqdm(list(zip(prompt_set, prompts)), desc="prompts")):
        for name, drafter in drafters.items():  # interleaved per prompt
            recorders[name].prompt = spec.id
            generate(target, ids, drafter=drafter, max_new_tokens=ds.max_new_tokens, seed=cfg.seed + i, sampling=sampling,
                     verifier=Verifier(sampled=recorders[name]))
    out = {"config": {"dataset": ds.name, "temperature": sampling.temperature, "top_k": sampling.top_k,
                      "top_p": sampling.top_p, "experiment": args.experiment, "prompts": len(prompts), "target": m.target}, "methods": {}}
    print(f"{'method':16s} {'rule':10s} {'drafts':>6s} {'E[tau] token':>12s} {'E[tau] rule':>11s} {'ratio':>6s} {'per prompt':>14s}")
    for name, rec in recorders.items():
        by_prompt = defaultdict(list)
        for r in rec.rows:
            by_prompt[r["prompt"]].append(r)
        ratio = lambda rows: sum(1 + r["rule"] for r in rows) / sum(1 + r["token"] for r in rows)  # noqa: E731
        per_prompt = [ratio(rows) for rows in by_prompt.values()]
        rules = sorted({r["other"] for r in rec.rows})
        summary = {"drafts": len(rec.rows), "rules": rules,
                   "tau_token": statistics.fmean(1 + r["token"] for r in rec.rows),
                   "tau_rule": statistics.fmean(1 + r["rule"] for r in rec.rows),
                   "ratio": ratio(rec.rows), "ratio_per_prompt": per_prompt}
        out["methods"][name] = summary
        print(f"{name:16s} {'/'.join(rules):10s} {len(rec.rows):6d} {summary['tau_token']:12.3f} {summary['tau_rule']:11.3f} "
              f"{summary['ratio']:6.3f} {min(per_prompt):6.3f}-{max(per_prompt):.3f}")
    if args.out:
        write_json_atomic(Path(args.out), out)


def report(args) -> None:
    """Per method: τ (and its range over prompts), speedup (and its range: per prompt, tokens/s
    over the baseline's), the acceptance rule's and the target forward's time per step."""
    print(f"{'run':16s} {'method':20s} {'tau':>5s} {'tau range':>11s} {'speedup':>8s} {'range':>12s} "
          f"{'accept ms/step':>14s} {'target ms/step':>14s}")
    for root in args.runs:
        for job in load_jobs(root)[0]:
            steps = defaultdict(list)
            for row in job.steps():
                steps[row["method"]].append(row)
            cfg = job.summary.config
            label = f"{cfg['dataset']['name']} T{cfg['sampling'].get('temperature')}"
            base = job.summary.methods["ar"].tokens_per_s_by_prompt
            for name, m in job.summary.methods.items():
                rows = steps[name]
                by_prompt = defaultdict(list)
                for r in rows:
                    by_prompt[r["prompt"]].append(r["emitted"])
                taus = [statistics.fmean(e) for e in by_prompt.values()]
                ratios = [m.tokens_per_s_by_prompt[p] / base[p] for p in base if p in m.tokens_per_s_by_prompt]
                accept = 1000 * statistics.fmean(r.get("accept_time_s", 0.0) for r in rows)
                forward = 1000 * statistics.fmean(r["target_time_s"] for r in rows)
                print(f"{label:16s} {name:20s} {m.stats.tau:5.2f} {min(taus):5.2f}-{max(taus):<5.2f} {m.speedup:7.2f}x "
                      f"{min(ratios):5.2f}-{max(ratios):.2f}x {accept:14.2f} {forward:14.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("paired", help="every rule's exact expectation on the same drafts")
    p.add_argument("--out", help="write the numbers to this JSON file")
    p.add_argument("--experiment", default="bench/verify", help="the experiment whose token-wise methods draft")
    r = sub.add_parser("report", help="tau, speedup and rule time per step of bench/verify runs")
    r.add_argument("runs", nargs="+")
    args, overrides = ap.parse_known_args()
    if args.cmd == "paired":
        paired(args, overrides)
    else:
        report(args)


if __name__ == "__main__":
    main()
