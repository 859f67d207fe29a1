"""Trace replay: predict τ and speedup of other draft lengths from one recorded greedy chain run.

What the record holds (``steps.jsonl``): per step the drafted tokens, the accepted count and the
timings; the output sequence equals the target's greedy output. Let M(s) be the number of
draft tokens the target accepts when a round starts at output position s. For a deterministic
autoregressive LM drafter without a stop policy the draft from position s + j, inside an
accepted run, is the remainder of the draft from s (the context ends with the drafter's own
tokens), so one recorded round starting at s with a accepted out of k fixes

    M(s + j) = a - j                for j <= a, when a < k   (exact)
    M(s + j) >= k - j               when a == k               (censored)

i.e. M is known at every output position, up to censoring at the recorded draft length. A
replay with draft length γ then walks the output: at s it emits min(M(s), γ) + 1 tokens. Where
M(s) is censored below γ the replay draws M from its empirical distribution conditioned on the
bound (a Kaplan-Meier estimate over all positions): exact where the record allows, in
expectation elsewhere. For other drafters (n-gram, stop policies) every M is drawn this way.

Time: a round of length γ costs verify(γ) + γ t_draft, with verify linear between the
autoregressive step (1 token) and the recorded verification forwards (k + 1 tokens), and
t_draft the recorded drafter time per drafted token. The target's and the drafter's prefills of
the prompt are per-prompt costs, taken as recorded.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import numpy as np

from analysis.gather import GatherError, load_jobs


# drafter kinds whose draft from inside an accepted run is the rest of the earlier draft. Not the
# int8-dynamic drafter: it quantizes activations per forward, so its logits at a position depend
# on which other tokens share the forward (measured: a prompt-sized catch-up and a one-token
# forward draft different tokens), and a draft is not a function of its context alone.
EXACT_KINDS = ("small_lm", "layer_skip")


@dataclass
class ChainTrace:
    outputs: dict[str, int]  # prompt -> output length
    known: dict[str, dict[int, tuple[int, bool]]]  # prompt -> position -> (M or its bound, censored)
    k: int  # recorded draft length
    exact_drafter: bool
    t_draft_token: float
    drafter_prefill_s: float  # the drafter's prefills of the prompts, summed
    t_verify_k: float  # recorded verification forward (k + 1 tokens)
    t_ar_step: float  # autoregressive step (1 token)
    prefill_s: float
    ar_tokens_per_s: float


def trace_from_job(job, exact_drafter: bool | None = None) -> ChainTrace:
    name = next(iter(job.summary.compared))
    info = job.drafter(name)
    k = int(info.budget or 0)
    if k < 1 or info.parts:
        raise GatherError(f"{job.dir}: trace replay needs a single-drafter chain run with a draft length k")
    if not job.summary.greedy:
        raise GatherError(f"{job.dir}: trace replay needs a greedy run")
    if exact_drafter is None:  # an autoregressive LM drafter without a stop policy
        exact_drafter = info.kind in EXACT_KINDS and info.stop == "FixedK"
    known: dict[str, dict[int, tuple[int, bool]]] = {}
    outputs: dict[str, int] = {}
    pos: dict[str, int] = {}
    for st in job.steps():
        if st["method"] != name:
            continue
        p = st["prompt"]
        s = pos.get(p, 0)
        a, d = st["accepted"], st["drafted"]
        kn = known.setdefault(p, {})
        if d:
            censored = a == d  # (then a >= 1)
            # an exact drafter fixes M along the accepted run (and at the rejection, M = 0);
            # otherwise only at the round's start
            span = (a if censored else a + 1) if exact_drafter else 1
            for j in range(span):
                kn.setdefault(s + j, (a - j, censored))
        pos[p] = s + st["emitted"]
        outputs[p] = pos[p]
    m = job.summary.methods[name].stats
    base = job.summary.methods[job.summary.baseline].stats
    return ChainTrace(outputs, known, k, exact_drafter, m.draft_time_per_token_s, m.drafter_prefill_time_s,
                      m.target_time_per_forward_s, base.target_time_per_forward_s, m.prefill_time_s, base.tokens_per_s)


def _km_sampler(trace: ChainTrace):
    """Draw M from its empirical law, optionally conditioned on M >= bound (censoring-aware)."""
    values = [(m, c) for kn in trace.known.values() for m, c in kn.values()]
    uncensored = np.array(sorted(m for m, c in values if not c))
    censored = np.array([m for m, c in values if c])

    def draw(rng: random.Random, bound: int = 0) -> float:
        # survival beyond the largest recorded value is unknown: treat censored values there as M = bound
        pool = uncensored[uncensored >= bound]
        n_cens = int((censored >= bound).sum())
        total = len(pool) + n_cens
        if total == 0:
            return bound
        i = rng.randrange(total)
        return float(pool[i]) if i < len(pool) else float(max(bound, trace.k))
    return draw


def replay(trace: ChainTrace, gamma: int, samples: int = 50, seed: int = 0) -> dict:
    """Predicted τ, tokens/s and speedup of draft length ``gamma``; and the share of rounds whose
    acceptance was read exactly from the record."""
    rng = random.Random(seed)
    draw = _km_sampler(trace)
    verify = trace.t_ar_step + (trace.t_verify_k - trace.t_ar_step) * gamma / trace.k
    step_cost = verify + gamma * trace.t_draft_token
    taus, tps, exact_share = [], [], []
    for _ in range(samples):
        steps = exact = 0
        tokens = 0
        for p, length in trace.outputs.items():
            kn = trace.known.get(p, {})
            s = 0
            while s < length:
                m, censored = kn.get(s, (0, True))
                room = min(gamma, length - s - 1)  # the draft budget left at s
                if room <= 0 or (s in kn and (not censored or m >= room)):
                    acc = min(m, room)
                    exact += 1
                else:
                    acc = min(int(draw(rng, m if s in kn else 0)), gamma)
                acc = min(acc, length - s - 1)
                s += acc + 1
                steps += 1
            tokens += length
        taus.append(tokens / steps)
        tps.append(tokens / (trace.prefill_s + trace.drafter_prefill_s + steps * step_cost))
        exact_share.append(exact / steps)
    tau, rate = float(np.mean(taus)), float(np.mean(tps))
    return {"gamma": gamma, "tau": tau, "tokens_per_s": rate, "speedup": rate / trace.ar_tokens_per_s,
            "exact_share": float(np.mean(exact_share))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="the recorded run (a job directory)")
    ap.add_argument("--gammas", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--compare", help="a sweep directory with real runs of other draft lengths")
    args = ap.parse_args(argv)
    jobs, _ = load_jobs(args.trace)
    if len(jobs) != 1:
        print(f"{args.trace}: expected one run, found {len(jobs)}", file=sys.stderr)
        return 1
    trace = trace_from_job(jobs[0])
    real = {}
    if args.compare:
        for job in load_jobs(args.compare)[0]:
            name = next(iter(job.summary.compared))
            k = job.drafter(name).budget
            if k and job.dir != jobs[0].dir:
                real[int(k)] = job.summary.methods[name]
    print(f"trace: {args.trace} (k={trace.k}, exact drafter replay: {trace.exact_drafter})")
    print(f"{'gamma':>5s} {'tau_pred':>8s} {'speedup_pred':>12s} {'exact':>6s} {'tau_real':>8s} {'speedup_real':>12s} {'error':>7s}")
    for g in [int(x) for x in args.gammas.split(",")]:
        r = replay(trace, g)
        line = f"{g:5d} {r['tau']:8.2f} {r['speedup']:11.2f}x {r['exact_share']:6.0%}"
        if g in real:
            err = r["speedup"] / real[g].speedup - 1
            line += f" {real[g].tau:8.2f} {real[g].speedup:11.2f}x {err:+7.1%}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
