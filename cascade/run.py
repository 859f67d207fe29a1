"""`python -m cascade.run +experiment=NAME [overrides]`: one experiment, baseline included.

``run(cfg) -> dict`` does the work and is what tests call; ``main`` is the thin Hydra wrapper.
A run validates everything it can before loading a model (missing values, unknown ``_target_``
classes, the dataset), loads the target and the method's drafter, then decodes every prompt
with the autoregressive baseline and with the method, interleaved prompt by prompt in this one
process (after a warm-up), and writes into the output directory:

``summary.json``
    config echo, environment, and per method (keyed by its name): ``drafter`` (what the method
    is: kind, draft budget, stop policy and the drafters inside, from ``Drafter.describe``),
    ``tau``, ``alpha`` (chains) or ``tree_acceptance`` (trees), ``c``, ``tokens_per_s``,
    ``speedup`` against the baseline, and the generated token ids per prompt.
``steps.jsonl``
    one line per decoding step (method, prompt index, and the fields of ``StepRecord``).

Both files are written to a temporary name and renamed, so an interrupted run leaves no half
file; a directory that already holds a ``summary.json`` is refused unless ``overwrite=true``.
"""

from __future__ import annotations

import logging
import platform
import subprocess
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from cascade.data import encode, load_prompts
from cascade.decode import generate
from cascade.metrics import decomposition, prediction, speedup, summarize, write_json_atomic, write_jsonl_atomic
from cascade.models import load_model

log = logging.getLogger(__name__)
BASELINE = "ar"


class ConfigError(ValueError):
    """The configuration cannot be run; raised before any model is loaded."""


def _targets(node) -> list[str]:
    """Every ``_target_`` string in a config subtree."""
    if isinstance(node, dict):
        found = [node["_target_"]] if "_target_" in node else []
        return found + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def validate(cfg: DictConfig) -> None:
    """Fail fast with a clear message: missing values, unknown classes, bad sampling values."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing required value(s): {', '.join(missing)} (set them on the command line, e.g. {missing[0]}=...)")
    for target in _targets(OmegaConf.to_container(cfg.method, resolve=False)):
        try:
            get_object(target)
        except ImportError as exc:
            raise ConfigError(
                f"method {cfg.method.name!r} needs {target}, which is not yet available in this version of cascade"
            ) from exc
    if cfg.sampling.temperature < 0:
        raise ConfigError(f"sampling.temperature must be >= 0, got {cfg.sampling.temperature}")


def _environment(target) -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "torch": version("torch"),
        "transformers": version("transformers"),  # metadata: the lazy module may lack __version__ after unpickling
        "python": platform.python_version(),
        "device": str(target.device),
        "dtype": str(target.dtype),
        "threads": torch.get_num_threads(),
        "git_commit": commit,
    }


def _output_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or "outputs/run")


def decode_interleaved(target, methods: dict, prompts: list[list[int]], max_new_tokens: int, *, warmup: bool = True,
                       progress: bool = True, seed: int = 0, **sampling) -> dict[str, list]:
    """Every method (name -> drafter, None = autoregressive) on every prompt, interleaved prompt by
    prompt so that machine noise hits all methods alike, after one short warm-up generation per
    method. Prompt i is decoded with seed ``seed + i``. Returns name -> [Generation per prompt]."""
    if warmup:
        for drafter in methods.values():
            generate(target, prompts[0][:32], drafter=drafter, max_new_tokens=min(8, max_new_tokens), seed=0, **sampling)
    gens: dict[str, list] = {name: [] for name in methods}
    for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        for name, drafter in methods.items():
            gens[name].append(generate(target, ids, drafter=drafter, max_new_tokens=max_new_tokens, seed=seed + i, **sampling))
    return gens


def heldout(gens: dict[str, list], name: str) -> dict | None:
    """Predict the second half of the prompts from the first: ``metrics.prediction`` with the
    first half's measurements (against the baseline on the same prompts) as the fit. None with
    fewer than two prompts."""
    n = len(gens[BASELINE])
    if n < 2:
        return None
    half = n // 2
    fit, test = (summarize(gens[name][:half]), summarize(gens[BASELINE][:half])), (summarize(gens[name][half:]), summarize(gens[BASELINE][half:]))
    return {"fit_prompts": half, "test_prompts": n - half, **prediction(*fit, *test)}


def by_category(prompt_set, gens: list, base: list) -> dict | None:
    """Per prompt category (``Prompt.category``, in order of appearance): prompts, τ, tok/s and
    the speedup against the baseline on the same prompts. None when there is one category."""
    cats = [p.category for p in prompt_set]
    if len(set(cats)) < 2:
        return None
    out = {}
    for c in dict.fromkeys(cats):
        idx = [i for i, x in enumerate(cats) if x == c]
        s, b = summarize([gens[i] for i in idx]), summarize([base[i] for i in idx])
        out[c] = {"prompts": len(idx), "tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": speedup(s, b)}
    return out


def _fmt(x, spec: str = "{:.2f}x") -> str:
    return "-" if x is None else spec.format(x)


def _table(results: dict) -> str:
    """alpha: a chain's acceptance; a tree's (accepted path / nodes) is shown as `tree 0.xxx`.
    decomposed: the in-sample per-depth decomposition; predicted / measured: the second half of
    the prompts, predicted from the first half."""
    lines = [f"{'method':16s} {'tau':>6s} {'alpha':>10s} {'tok/s':>8s} {'speedup':>8s} {'decomposed':>10s} "
             f"{'2nd half: predicted':>19s} {'measured':>8s}"]
    for name, r in results.items():
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.3f}"
        if r["tree_acceptance"] is not None:
            alpha = f"tree {r['tree_acceptance']:.3f}"
        h = r["heldout"] or {}
        lines.append(f"{name:16s} {r['tau']:6.2f} {alpha:>10s} {r['tokens_per_s']:8.2f} {r['speedup']:7.2f}x "
                     f"{_fmt(r['decomposed_speedup_per_depth']):>10s} {_fmt(h.get('predicted_speedup')):>19s} "
                     f"{_fmt(h.get('measured_speedup') if h.get('predicted_speedup') is not None else None):>8s}")
        for level, lv in r["levels"].items():
            if lv["alpha"] is not None:
                lines.append(f"  level {level}: alpha {lv['alpha']:.3f}, c {lv['c']:.3f}")
        if r.get("by_category") and name != BASELINE:
            lines.append("  by category (tau, speedup): " + ", ".join(
                f"{c} {v['tau']:.2f} {v['speedup']:.2f}x" for c, v in r["by_category"].items()))
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict:
    """Run one experiment; returns the summary that is also written to ``summary.json``."""
    validate(cfg)
    out_dir = _output_dir(cfg)
    if (out_dir / "summary.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"{out_dir / 'summary.json'} exists: refusing to mix runs (pass overwrite=true)")
    ds = cfg.dataset
    prompt_set = load_prompts(ds.name, ds.num_prompts, ds.path, ds.field, ds.get("per_category", 3))  # before any model loads
    torch.set_num_threads(cfg.threads)

    m = cfg.models
    target = load_model(m.target, dtype=m.dtype, device=m.device, onednn=m.onednn)
    methods = {BASELINE: None}
    if cfg.method.name != BASELINE:
        methods[cfg.method.name] = instantiate(cfg.method.drafter)
    prompts = [encode(target, p, ds.chat_template) for p in prompt_set]
    log.info("%d prompts, methods %s, target %s", len(prompts), list(methods), m.target)

    sampling = dict(temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p)
    gens = decode_interleaved(target, methods, prompts, ds.max_new_tokens, warmup=cfg.warmup, progress=cfg.progress,
                              seed=cfg.seed, **sampling)
    base = summarize(gens[BASELINE])
    results = {}
    for name, g in gens.items():
        s = summarize(g)
        drafter = methods[name]
        info = asdict(drafter.describe()) if drafter is not None else {"kind": "autoregressive", "name": name, "budget": 0,
                                                                        "stop": None, "parts": []}
        results[name] = {
            "drafter": info,
            "tau": s["tau"],
            "alpha": s["alpha"],
            "tree_acceptance": s["tree_acceptance"],
            "c": s["c_by_drafter"],
            "alpha_by_drafter": s["alpha_by_drafter"],
            "tokens_per_s": s["tokens_per_s"],
            "speedup": speedup(s, base),
            **decomposition(s, base),
            # out of sample: the second half of the prompts predicted from the first
            "heldout": (h := heldout(gens, name)),
            "predicted_speedup": None if h is None else h["predicted_speedup"],
            "measured_over_predicted": None if h is None else h["measured_over_predicted"],
            "by_category": by_category(prompt_set, g, gens[BASELINE]),
            "levels": s["levels"],
            "overhead_frac": s["overhead_frac"],
            "detail": s,
            "tokens": {p.id: gen.tokens for p, gen in zip(prompt_set, g)},
            # per prompt, for the spread of speedups across prompts (analysis figures)
            "tokens_per_s_by_prompt": {p.id: len(gen.tokens) / gen.wall_time_s for p, gen in zip(prompt_set, g)},
        }
    summary = {
        "experiment": cfg.experiment_name,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "environment": _environment(target),
        "baseline": BASELINE,
        "methods": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(
        out_dir / "steps.jsonl",
        ({"method": n, "prompt": p.id, **s.to_dict()} for n, g in gens.items() for p, gen in zip(prompt_set, g) for s in gen.steps),
    )
    write_json_atomic(out_dir / "summary.json", summary)  # last: its presence marks a complete run
    print(_table(results))
    log.info("results in %s", out_dir)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
