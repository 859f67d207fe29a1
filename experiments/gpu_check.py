"""One-command device check: what must hold on a CUDA machine, written as one markdown report.

Steps (each timed; a failing step is reported and the others still run; exit status 1 if any failed):

1. greedy equality against transformers' own ``generate`` on the same weights: the target alone,
   a small-LM chain, a two-level vertical cascade and a DyTC tree (tree-attention mask on the
   device); a divergence is reported with the target's top-2 logit gap there and passes only
   at a near-tie;
2. the deep chi-square test (tests/deep_stats.py) for three methods (chain, static tree,
   vertical cascade) with the tiny float64 models on the device;
3. a quantized drafter: NF4 through bitsandbytes on CUDA (int8 dynamic on CPU), drafting for the
   target under greedy equality;
4. forward cost: the target's forward time at 1, 4, 16 and 32 inputs, checked against the
   roofline's shape (:func:`forward_cost_ok`): a 4-token forward of a 1.5B model is bandwidth-bound
   on any accelerator or CPU (at most 2x the 1-token one), and no k-token forward may cost more
   than k one-token forwards (1.25x slack for timer noise) -- a batched forward slower than that is
   broken batching, not a slow machine;
5. the main job, ``python -m cascade.run +experiment=csd_two_level``: it must exit 0 and its
   summary must show every greedy method's tokens equal to the baseline's on every prompt, a
   divergence passing only at a near-tie (the target's top-2 gap there);
6. the roofline's prediction against this device: ``bench/dytc_device`` (chains, DyTC over the
   head, the quantized 0.5B and prompt lookup; 4 HumanEval prompts, an untrained head) measured
   here, and on a virtual clock of the device table's entry for this GPU (``cascade/costs.py``:
   ``h100`` or ``a100`` by name); per method the predicted and the measured decode speedup and
   their ratio (reported, not asserted: the measurement the prediction has never had).

Default: the Qwen2.5-Coder pair in bf16 on CUDA (``models.device=cuda``). ``--tiny``: the same
steps with tiny random models on the CPU in float32 (what the default test suite runs, so the
script cannot rot), in about a minute.

    bash scripts/gpu_check.sh [--tiny] [--out REPORT.md]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the deep chi-square harness

from cascade import generate, load_model  # noqa: E402
from cascade.cascades import VerticalCascade  # noqa: E402
from cascade.data import BUILTIN, encode_prompt  # noqa: E402
from cascade.drafters import NGramDrafter, QuantizedLMDrafter, SmallLMDrafter  # noqa: E402
from cascade.evaluate import TransformersGenerate, divergences  # noqa: E402
from cascade.trees.drafter import TreeDrafter  # noqa: E402
from cascade.trees import DynamicTreePolicy, StaticTreePolicy  # noqa: E402
from cascade.types import SamplingConfig  # noqa: E402

NEAR_TIE = {"bfloat16": 0.25, "float32": 1e-3}  # top-2 logit gap a divergence may show (bf16 rounds logits coarsely)


class Report:
    def __init__(self, title: str) -> None:
        self.lines = [f"# {title}", ""]
        self.failed: list[str] = []

    def step(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            body, ok = fn()
        except Exception:  # a crashing step is a failed step, and the others still run
            body, ok = "```\n" + traceback.format_exc()[-3000:] + "```", False
        status = "passed" if ok else "FAILED"
        if not ok:
            self.failed.append(name)
        self.lines += [f"## {name}: {status} ({time.perf_counter() - t0:.0f} s)", "", body, ""]
        print(f"{name}: {status}", flush=True)


def greedy_equality(target, drafters: dict, prompt_set, prompts, n: int, dtype: str):
    """Each method's greedy tokens against transformers' own generate on the target's module
    (``TransformersGenerate``), divergences with the target's top-2 gap (``evaluate.divergences``)."""
    rows, ok = ["| method | prompts | identical | divergences (prompt, position, top-2 gap) | accepted |",
                "| --- | --- | --- | --- | --- |"], True
    reference = [TransformersGenerate().decode(target, ids, n, SamplingConfig(), 0) for ids in prompts]
    for name, make in drafters.items():
        gens = [generate(target, ids, drafter=make() if make else None, max_new_tokens=n) for ids in prompts]
        found = divergences(target, prompt_set, prompts, gens, reference)
        ok &= all(d.top2_gap < NEAR_TIE[dtype] for d in found)
        accepted = sum(s.accepted for g in gens for s in g.steps)
        rows.append(f"| {name} | {len(prompts)} | {len(prompts) - len(found)} | "
                    f"{[(d.prompt, d.position, d.top2_gap) for d in found] or 'none'} | {accepted} |")
    return "\n".join(rows), ok


def deep_chi_square(device: str, n: int, settings=("temperature", "top_k", "top_p")):
    import test_lossless_deep as deep
    from deep_stats import LEVEL

    target = deep.damped(device=device)
    models = (target, deep.perturbed_copy(target, 0.35, seed=3), deep.perturbed_copy(target, 0.6, seed=4))
    makes = {
        "chain_small_lm": lambda: SmallLMDrafter(models[1], k=5),
        "static_tree": lambda: TreeDrafter([SmallLMDrafter(models[1])], StaticTreePolicy((2, 2, 1, 1))),
        "vertical_2": lambda: VerticalCascade([SmallLMDrafter(models[1], k=5), SmallLMDrafter(models[2], k=2)]),
    }
    rows, ok = [f"| method | setting | generations | p | depths |", "| --- | --- | --- | --- | --- |"], True
    for (name, make), setting in zip(makes.items(), settings):
        samples, p = deep._check(models, name, setting, n, drafter=make)
        exercised = samples.exercised(4, 20)
        ok &= p > LEVEL and exercised
        rows.append(f"| {name} | {setting} | {n} | {p:.3g} | {samples.depth_report()} |")
    return "\n".join(rows), ok


def forward_cost(target, ks=(1, 4, 16, 32), repeats: int = 5):
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    cache = target.new_cache()
    target.forward(list(range(1, 65)), cache)  # a 64-token context
    past = target.cache_len(cache)
    # every k once per repeat, interleaved, so that a burst of load on a shared host (the suite's
    # other worker, another job) slows one sample of each k rather than all samples of one k
    times = {k: float("inf") for k in ks}
    for _ in range(repeats):
        for k in ks:
            sync()
            t0 = time.perf_counter()
            target.forward(list(range(1, k + 1)), cache)
            sync()
            times[k] = min(times[k], time.perf_counter() - t0)
            target.crop(cache, past)
    rows = ["| inputs | ms (fastest of %d) | ratio to 1 |" % repeats, "| --- | --- | --- |"]
    rows += [f"| {k} | {1000 * t:.1f} | {t / times[1]:.2f} |" for k, t in times.items()]
    problems = forward_cost_problems(times)
    return "\n".join(rows + [""] + (problems or ["roofline shape: as expected"])), not problems


def forward_cost_problems(times: dict[int, float], memory_bound_k: int = 4, memory_bound_ratio: float = 2.0,
                          slack: float = 1.25) -> list[str]:
    """What is wrong with forward times {k: seconds} against the roofline's shape (empty: nothing).
    Up to ``memory_bound_k`` inputs a forward streams the same weights as one input, so it may
    cost at most ``memory_bound_ratio`` x the 1-input forward; no k-input forward may cost more
    than k 1-input forwards (``slack`` for timer noise)."""
    problems, one = [], times[1]
    if not all(t > 0 for t in times.values()):
        problems.append(f"non-positive times: {times}")
        return problems
    for k, t in times.items():
        if k <= memory_bound_k and t > memory_bound_ratio * one:
            problems.append(f"{k} inputs cost {t / one:.2f}x one input (the roofline allows ~1x, this check {memory_bound_ratio}x)")
        if t > slack * k * one:
            problems.append(f"{k} inputs cost {t / one:.2f}x one input: more than {k} one-input forwards")
    return problems


def main_job(tiny: bool, device: str, run_dir: Path, near_tie: float):
    args = [sys.executable, "-m", "cascade.run", "+experiment=csd_two_level", "progress=false", "overwrite=true",
            f"hydra.run.dir={run_dir}"]
    args += ["debug=tiny"] if tiny else ["models.device=" + device, "models.backend=bfloat16", "models.drafter_backend=bfloat16"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    table = [ln for ln in proc.stdout.splitlines() if ln.strip()][-6:]
    if proc.returncode != 0:
        return "```\n" + proc.stderr[-3000:] + "\n```", False
    problems = main_job_problems(run_dir / "summary.json", near_tie)
    body = "```\n" + "\n".join(table) + "\n```\n\n" + ("\n".join(problems) or "every greedy output equals the baseline's")
    return body, not problems


def main_job_problems(summary_path: Path, near_tie: float) -> list[str]:
    """What the main job's summary shows wrong (empty: nothing): a missing summary, or a greedy
    method whose tokens left the baseline's on some prompt other than at a near-tie."""
    from cascade.results import load_jobs

    if not summary_path.is_file():
        return [f"no summary at {summary_path}"]
    jobs, _ = load_jobs(summary_path.parent)
    run = jobs[0].summary
    if not run.greedy:
        return []
    problems = []
    for name, method in run.compared.items():
        if method.identical_to_baseline is None:
            problems.append(f"{name}: no greedy comparison with the baseline recorded")
            continue
        bad = [d for d in method.divergences if d.top2_gap is None or d.top2_gap >= near_tie]
        if method.identical_to_baseline + len(method.divergences) != run.num_prompts or bad:
            problems.append(f"{name}: {method.identical_to_baseline}/{run.num_prompts} prompts identical; divergences "
                            f"{[(d.prompt, d.position, d.top2_gap) for d in method.divergences]}")
    return problems


def device_entry(gpu: str) -> str:
    """The DEVICES entry whose roofline predicts this GPU (by its name; h100 when unknown)."""
    return "a100" if "A100" in gpu.upper() else "h100"


def roofline_prediction(tiny: bool, device: str, run_dir: Path, entry: str):
    """bench/dytc_device measured on ``device`` and on ``entry``'s virtual clock; the two decode
    speedups per method side by side."""
    from cascade.results import load_jobs

    common = [sys.executable, "-m", "cascade.run", "+experiment=bench/dytc_device", "progress=false", "overwrite=true",
              "dataset=humaneval", "dataset.num_prompts=4", "models.head=init"]
    common += ["debug=tiny"] if tiny else ["models.device=" + device, "models.backend=bfloat16", "models.drafter_backend=bfloat16"]
    speed = {}
    for label, extra in (("measured", []), ("predicted", [f"device_model={entry}"])):
        out_dir = run_dir / label
        proc = subprocess.run(common + extra + [f"hydra.run.dir={out_dir}"], capture_output=True, text=True, cwd=ROOT,
                              timeout=1800)
        if proc.returncode != 0:
            return "```\n" + proc.stderr[-3000:] + "\n```", False
        run = load_jobs(out_dir)[0][0].summary
        speed[label] = {m: r.decode_speedup for m, r in run.methods.items()}
    rows = ["| method | measured decode speedup | PREDICTED (" + entry + " roofline) | predicted / measured |",
            "| --- | --- | --- | --- |"]
    for m, measured in speed["measured"].items():
        predicted = speed["predicted"].get(m)
        ratio = "-" if not (predicted and measured) else f"{predicted / measured:.2f}"
        rows.append(f"| {m} | {measured:.2f}x | {predicted:.2f}x | {ratio} |")
    return "\n".join(rows), True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the suite's check of this script)")
    ap.add_argument("--out", default=None, help="the report (default: docs/gpu_check.md, or outputs/gpu_check_tiny.md)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per greedy generation (default 48; tiny: 12)")
    args = ap.parse_args()
    tiny = args.tiny
    if not tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU check", file=sys.stderr)
        return 2
    device, dtype = ("cpu", "float32") if tiny else ("cuda", "bfloat16")
    out = Path(args.out or (ROOT / ("outputs/gpu_check_tiny.md" if tiny else "docs/gpu_check.md")))
    n = args.tokens or (12 if tiny else 48)
    torch.set_num_threads(2 if tiny else torch.get_num_threads())
    target = load_model("tiny:0" if tiny else "qwen2.5-coder-1.5b", backend=dtype, device=device)
    small = load_model("tiny:1" if tiny else "qwen2.5-coder-0.5b", backend=dtype, device=device)
    # tiny models are random: the target drafts for itself so that drafts are accepted
    drafter_lm = target if tiny else small
    prompt_set = BUILTIN[: 2 if tiny else 4]
    prompts = [encode_prompt(target, p.text) for p in prompt_set]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not tiny else "none (CPU)"
    report = Report("Device check" + (" (tiny models, CPU)" if tiny else ""))
    report.lines += [f"Command: `bash scripts/gpu_check.sh{' --tiny' if tiny else ''}`; commit {commit}; "
                     f"device {gpu}; torch {torch.__version__}; python {platform.python_version()}; {dtype}.", ""]
    drafters = {
        "autoregressive": None,
        "chain (small LM, k 4)": lambda: SmallLMDrafter(drafter_lm, k=4),
        "vertical cascade (small LM <- prompt lookup)": lambda: VerticalCascade([SmallLMDrafter(drafter_lm, k=6), NGramDrafter(k=3)]),
        "DyTC tree (small LM + prompt lookup)": lambda: TreeDrafter(
            [SmallLMDrafter(drafter_lm), NGramDrafter(k=1)],
            DynamicTreePolicy(t_min=0.02, max_nodes=16, max_depth=5, max_rank=2, prior_drafter_cost=0.05,
                              measure_costs=False)),
    }
    report.step("1. greedy equality with transformers' generate", lambda: greedy_equality(target, drafters, prompt_set, prompts, n, dtype))
    # --tiny: one setting (one exact reference to enumerate) and fewer generations, to stay near a minute
    report.step("2. deep chi-square on the device", lambda: deep_chi_square(
        device, 300, ("temperature",) * 3) if tiny else deep_chi_square(device, 1000))
    quant = "int8_dynamic" if tiny else "nf4"
    report.step(f"3. quantized drafter ({quant})", lambda: greedy_equality(
        target, {f"{quant} chain": lambda: QuantizedLMDrafter(drafter_lm, quant, k=4)}, prompt_set, prompts, n, dtype))
    report.step(f"4. forward cost ({dtype})", lambda: forward_cost(target, repeats=25 if tiny else 5))
    report.step("5. the main job", lambda: main_job(tiny, device, out.parent / (out.stem + "_run"), NEAR_TIE[dtype]))
    entry = device_entry(gpu)
    report.step(f"6. the {entry} roofline's prediction against this device", lambda: roofline_prediction(
        tiny, device, out.parent / (out.stem + "_roofline"), entry))
    report.lines += ["Failed: " + (", ".join(report.failed) if report.failed else "none"), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report.lines))
    print(f"report: {out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
