"""Does a device's roofline predict a run's measured decode speedups? Out of sample.

Every decoding step records its model forwards (``StepRecord.forwards``: model, inputs, cached
positions) and the summary each model's shape (``RunSummary.forward_shapes``), so a step can be
priced on any ``cascade.costs.DEVICES`` entry after the fact. On the CPU that ran it:

1. the roofline alone: each step's predicted time (its forwards' roofline times plus the
   device's host work per step), no fit;
2. fitted on the first half of the prompts: measured step time = the device's host work + the
   sum over the step's forwards of ``scale[model]`` x that forward's roofline time (one scale
   per model: how far its kernels run from their floor), least squares over every step of every
   method, then applied to the second half. (No per-step intercept: below the compute knee a
   forward's roofline is flat in its inputs, so an intercept and the target's scale cannot be
   told apart.)
3. fitted per part on the first half: two scales per model, one for its forwards' weight and
   cache reads and one for their arithmetic (how far its kernels run from each roof), combined as
   the device combines them (the larger, or the sum) with the overheads under the read scale;
   the arithmetic-to-read ratio per model from a grid (``RATIOS``), the read scale by least
   squares for each pair of ratios, the pair with the least squared error kept. Where a host's
   bandwidth and its arithmetic drift apart (a shared host: its memory busy, its cores not), one
   scale per model moves a forward of eight inputs as far as a forward of one. Its errors on
   the first half itself are printed too (a fit, not a prediction): small there and large on
   the second half means the halves differ (the host moved), not that the model cannot fit.

Each method's predicted decode speedup on the second half (the baseline's predicted decode time
over the method's, per token) is printed beside the measured one. Predictions, labelled so.

    python -m analysis.roofline RUN_DIR [--device zen5_epyc]
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from cascade.costs import DEVICES, Device, combine
from cascade.results import load_jobs


def step_roofline(step: dict, shapes: dict, device: Device) -> float:
    """Predicted seconds of one recorded step on ``device``."""
    return device.host_step_s + sum(shapes[f["model"]].seconds(device, f["inputs"], f["context"]) for f in step["forwards"])


def halves(steps: list[dict]) -> tuple[set[str], set[str]]:
    """The first and second half of the prompts, in the order they were decoded."""
    prompts = list(dict.fromkeys(s["prompt"] for s in steps))
    half = len(prompts) // 2
    return set(prompts[:half]), set(prompts[half:])


def fit(steps: list[dict], shapes: dict, device: Device) -> dict[str, float]:
    """Scale per model: measured step time - host work = sum of scale[model] x roofline(forward),
    least squares over ``steps``."""
    models = sorted({f["model"] for s in steps for f in s["forwards"]})
    a = np.zeros((len(steps), len(models)))
    for r, s in enumerate(steps):
        for f in s["forwards"]:
            a[r, models.index(f["model"])] += shapes[f["model"]].seconds(device, f["inputs"], f["context"])
    y = np.array([s["step_time_s"] - device.host_step_s for s in steps])
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    return dict(zip(models, map(float, x)))


def fitted_seconds(step: dict, shapes: dict, device: Device, scale: dict) -> float:
    return device.host_step_s + sum(
        scale.get(f["model"], 1.0) * shapes[f["model"]].seconds(device, f["inputs"], f["context"]) for f in step["forwards"])


RATIOS = np.geomspace(0.25, 8.0, 31)  # arithmetic scale / read scale tried per model


@dataclass(frozen=True)
class PartScales:
    """Per model: the scale of its reads (and overheads) and the ratio of its arithmetic's to it."""

    reads: dict[str, float]
    ratio: dict[str, float]

    def forward(self, shape, device: Device, f: dict) -> float:
        overheads, reads, arithmetic = shape.parts(device, f["inputs"], f["context"])
        m = f["model"]
        return self.reads.get(m, 1.0) * (overheads + combine(device, reads, self.ratio.get(m, 1.0) * arithmetic))

    def seconds(self, step: dict, shapes: dict, device: Device) -> float:
        return device.host_step_s + sum(self.forward(shapes[f["model"]], device, f) for f in step["forwards"])


def fit_parts(steps: list[dict], shapes: dict, device: Device) -> PartScales:
    """Two scales per model (see the module docstring, 3.), least squares over ``steps``."""
    models = sorted({f["model"] for s in steps for f in s["forwards"]})
    y = np.array([s["step_time_s"] - device.host_step_s for s in steps])
    columns = []  # columns[m][j]: per step, model m's forwards summed with the arithmetic scaled by RATIOS[j]
    for model in models:
        rows, parts = [], []
        for r, s in enumerate(steps):
            for f in s["forwards"]:
                if f["model"] == model:
                    rows.append(r)
                    parts.append(shapes[model].parts(device, f["inputs"], f["context"]))
        overheads, reads, arithmetic = np.array(parts).T
        columns.append([np.bincount(rows, overheads + combine(device, reads, ratio * arithmetic), minlength=len(steps))
                        for ratio in RATIOS])
    best = None
    for picks in itertools.product(range(len(RATIOS)), repeat=len(models)):
        a = np.stack([columns[m][j] for m, j in enumerate(picks)], axis=1)
        x, *_ = np.linalg.lstsq(a, y, rcond=None)
        error = float(np.sum((a @ x - y) ** 2))
        if best is None or error < best[0]:
            ratios = [float(RATIOS[j]) for j in picks]
            best = (error, PartScales(dict(zip(models, map(float, x))), dict(zip(models, ratios))))
    return best[1]


def speedups(steps: list[dict], baseline: str, seconds) -> dict[str, float]:
    """Decode speedup per method (tokens per second over the baseline's) with ``seconds(step)``."""
    tokens: dict[str, float] = defaultdict(float)
    time: dict[str, float] = defaultdict(float)
    for s in steps:
        tokens[s["method"]] += s["emitted"]
        time[s["method"]] += seconds(s)
    base = tokens[baseline] / time[baseline]
    return {m: tokens[m] / time[m] / base for m in tokens}


def check(steps: list[dict], shapes: dict, baseline: str, device: Device) -> dict[str, dict[str, float]]:
    """method -> measured, roofline-alone and fitted decode speedups on the second half of the
    prompts (the fit saw only the first half)."""
    first, second = halves(steps)
    seen = [s for s in steps if s["prompt"] in first]
    scale = fit(seen, shapes, device)
    held = [s for s in steps if s["prompt"] in second]
    measured = speedups(held, baseline, lambda s: s["step_time_s"])
    alone = speedups(held, baseline, lambda s: step_roofline(s, shapes, device))
    fitted = speedups(held, baseline, lambda s: fitted_seconds(s, shapes, device, scale))
    per_part = fit_parts(seen, shapes, device)
    by_part = speedups(held, baseline, lambda s: per_part.seconds(s, shapes, device))
    seen_measured = speedups(seen, baseline, lambda s: s["step_time_s"])
    seen_by_part = speedups(seen, baseline, lambda s: per_part.seconds(s, shapes, device))
    return {m: {"measured": measured[m], "roofline": alone[m], "fitted": fitted[m], "per_part": by_part[m], "scales": scale,
                "part_scales": per_part, "in_sample_error": seen_by_part[m] / seen_measured[m] - 1} for m in measured}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--device", default="zen5_epyc", choices=sorted(DEVICES))
    args = ap.parse_args(argv)
    device = DEVICES[args.device]
    jobs, _ = load_jobs(args.run_dir)
    for job in jobs:
        summary = job.summary
        if summary.clock != "measured":
            print(f"{job.dir}: a virtual-clock run ({summary.clock}): nothing measured to predict")
            continue
        steps = [s for s in job.steps() if s.get("forwards")]
        if not steps:
            print(f"{job.dir}: its steps record no forwards (a run older than StepRecord.forwards)")
            continue
        rows = check(steps, summary.forward_shapes, summary.baseline, device)
        first = next(iter(rows.values()))
        scales, parts = first["scales"], first["part_scales"]
        print(f"{job.dir}: PREDICTED decode speedups on the second half of the prompts from the {device.name} roofline; "
              "fit on the first half: measured / roofline per model " + ", ".join(f"{k} {v:.2f}" for k, v in scales.items())
              + "; per part (reads, arithmetic) " + ", ".join(f"{k} {v:.2f}, {v * parts.ratio[k]:.2f}" for k, v in parts.reads.items()))
        print(f"{'method':22s} {'measured':>9s} {'roofline':>9s} {'error':>7s} {'fitted':>8s} {'error':>7s} {'per part':>9s} {'error':>7s}")
        for m, r in rows.items():
            print(f"{m:22s} {r['measured']:8.2f}x {r['roofline']:8.2f}x {r['roofline'] / r['measured'] - 1:+7.1%} "
                  f"{r['fitted']:7.2f}x {r['fitted'] / r['measured'] - 1:+7.1%} "
                  f"{r['per_part']:8.2f}x {r['per_part'] / r['measured'] - 1:+7.1%}")
        inside = [r["in_sample_error"] for r in rows.values()]
        print(f"  per part, on the first half it was fitted on (not a prediction): errors {min(inside):+.1%} to {max(inside):+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
