"""`python -m cascade.run +experiment=NAME [overrides]`: one experiment, baseline included.

``run(cfg) -> RunSummary`` does the work and is what tests call; ``main`` is the thin Hydra
wrapper. A run validates everything it can before loading a model (missing values, unknown
``_target_`` classes, sampling values, the dataset), loads the target and the methods, then
decodes every prompt with the autoregressive baseline and every method, interleaved prompt by
prompt in this one process after a warm-up (``cascade.evaluate``), and writes into the output
directory:

``summary.json``
    the :class:`~cascade.summary.RunSummary`: config echo, environment (CPU model and flags
    included), and per method (keyed by its name) a :class:`~cascade.summary.MethodSummary`:
    what the method is (``Drafter.describe``), its statistics (τ, α, c, tok/s, ...), speedup
    against the baseline, in-sample decomposition, held-out prediction, per-category rows,
    greedy divergences from the baseline, and the generated token ids per prompt.
``steps.jsonl``
    one line per decoding step (method, prompt id, and the fields of ``StepRecord``).

Methods: an experiment names several in ``methods`` (name -> a ``conf/method`` entry, composed
with ``/method@methods.NAME: ENTRY`` in its defaults list); with ``methods`` empty the run
compares the one ``method``. A method config holds ``drafter`` (cascade's loop; null:
autoregressive) or ``generate`` (an object with ``decode``/``describe``, e.g. transformers' own
``generate``: ``cascade.evaluate.TransformersGenerate``), and optionally ``verify``: the sampled
verification rule (``token``, ``block``, ``traversal``: ``cascade.verify``), else the run's
``verify``. A vertical cascade's inner rounds follow its method's rule where its config says
``verifier: ${..verify}`` (the ``conf/method`` cascades do).

Both files are written to a temporary name and renamed, so an interrupted run leaves no half
file; a directory that already holds a ``summary.json`` is refused unless ``overwrite=true``.
"""

from __future__ import annotations

import logging
import platform
from importlib.metadata import version
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from cascade import dirnames  # noqa: F401  (registers the job_dirname resolver hydra.sweep.subdir uses)
from cascade.costs import DEVICES
from cascade.data import HEAD_CORPORA, Prompt, encode, load_prompts, reserve_overlap
from cascade.evaluate import BASELINE, Method, SpeculativeMethod, decode_interleaved, summarize_methods
from cascade.metrics import write_json_atomic, write_jsonl_atomic
from cascade.models import load_model
from cascade.models.loading import shared_models
from cascade.models.backends.native import native_kernels, unavailable_reason
from cascade.provenance import code_state, cpu_identity, linear_kernels
from cascade.llamacpp import LlamaCppGenerate, LlamaCppUnavailable, server_binary
from cascade.summary import Environment, MethodSummary, RunSummary
from cascade.types import DrafterInfo, SamplingConfig
from cascade.validation import config_errors
from cascade.verify import VERIFIERS, verifier_named

log = logging.getLogger(__name__)


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


def method_configs(cfg: DictConfig) -> dict[str, DictConfig]:
    """name -> method config: ``methods`` when an experiment names several, else the one
    ``method``; the baseline is always run and always named ``ar``."""
    named = dict(cfg.methods) if cfg.get("methods") else {cfg.method.name: cfg.method}
    if BASELINE in named and (named[BASELINE].get("drafter") is not None or named[BASELINE].get("generate") is not None):
        raise ConfigError(f"method name {BASELINE!r} is the autoregressive baseline's; name this method differently")
    return {BASELINE: OmegaConf.create({"name": BASELINE, "drafter": None}), **{n: m for n, m in named.items() if n != BASELINE}}


def method_corpora(mcfg: DictConfig) -> list[str]:
    """The ``cascade.data`` corpora a method's drafters have read: every ``corpus`` list in its
    config (datastores, pruned heads) and, for a trained draft head (a ``head`` that is not
    "init"), every source a head may be trained on."""
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "corpus" and isinstance(value, list):
                    found.extend(value)
                elif key == "head" and isinstance(value, str) and value != "init":
                    found.extend(HEAD_CORPORA)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(OmegaConf.to_container(mcfg, resolve=True))
    return list(dict.fromkeys(found))


def check_reserve(prompts: list[Prompt], methods: dict[str, DictConfig]) -> None:
    """Refuse to evaluate prompts a method's corpora hold (their suffixes, tables or head training
    text would inflate its speedup): the evaluation reserve (``cascade.data.RESERVED_*``) is the
    only place benchmark prompts may come from when a method reads a corpus."""
    read = {name: method_corpora(mcfg) for name, mcfg in methods.items()}
    found = reserve_overlap(prompts, [c for corpora in read.values() for c in corpora])  # each corpus searched once
    for name, corpora in read.items():
        overlap = {c: found[c] for c in corpora if c in found}
        if overlap:
            said = "; ".join(f"{c} holds {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''} ({len(ids)})"
                             for c, ids in overlap.items())
            raise ConfigError(f"method {name!r} reads corpora that hold evaluated prompts: {said}. Evaluate inside the "
                              "reserve (HumanEval 0-39: dataset.num_prompts<=40; GSM8K 0-199: <=200) or drop the method")


def verify_rule(cfg: DictConfig, mcfg: DictConfig) -> str:
    """The sampled verification rule a method uses: its own ``verify``, else the run's."""
    return mcfg.get("verify") or cfg.get("verify") or "token"


def validate(cfg: DictConfig) -> SamplingConfig:
    """Fail fast with a clear message: missing values, unknown classes, bad sampling values.
    Returns the run's sampling settings (validated once, by ``SamplingConfig`` itself)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing required value(s): {', '.join(missing)} (set them on the command line, e.g. {missing[0]}=...)")
    device = cfg.get("device_model")
    if device is not None and device not in DEVICES:
        raise ConfigError(f"device_model: unknown device {device!r} (one of {', '.join(sorted(DEVICES))}; cascade/costs.py)")
    methods = method_configs(cfg)
    bad = config_errors(cfg, methods)
    if bad:
        raise ConfigError("bad value(s), nothing loaded: " + "; ".join(bad))
    for name, mcfg in methods.items():
        if mcfg.get("drafter") is not None and mcfg.get("generate") is not None:
            raise ConfigError(f"method {name!r} sets both drafter and generate; a method is one or the other")
        if device is not None and mcfg.get("generate") is not None:
            raise ConfigError(f"method {name!r} runs transformers' generate, whose forwards a virtual clock cannot price: "
                              f"drop it from a device_model={device} run (~methods.{name})")
        rule = verify_rule(cfg, mcfg)
        if rule not in VERIFIERS:
            raise ConfigError(f"method {name!r}: unknown verification rule {rule!r} (verify= one of {', '.join(VERIFIERS)})")
        for target in _targets(OmegaConf.to_container(mcfg, resolve=False)):
            try:
                obj = get_object(target)
            except ImportError as exc:
                raise ConfigError(
                    f"method {name!r} needs {target}, which is not yet available in this version of cascade"
                ) from exc
            if obj is LlamaCppGenerate:  # a peer program: its server must be built before any model loads
                try:
                    server_binary()
                except LlamaCppUnavailable as exc:
                    raise ConfigError(f"method {name!r}: {exc} (or drop it: ~methods.{name})") from exc
    try:
        return instantiate(cfg.sampling)
    except InstantiationException as exc:
        raise ConfigError(f"sampling: {exc.__cause__ or exc}") from exc


def build_method(mcfg: DictConfig, rule: str = "token") -> Method:
    """The object a method config describes (see the module docstring); ``rule`` names the target's
    verification rule (``cascade.verify.VERIFIERS``)."""
    if mcfg.get("generate") is not None:
        return instantiate(mcfg.generate)
    return SpeculativeMethod(None if mcfg.get("drafter") is None else instantiate(mcfg.drafter), verifier_named(rule))


def _environment(target, models: list) -> Environment:
    """Where the numbers come from: code, CPU, kernels, and every loaded model's backend."""
    code, cpu = code_state(), cpu_identity()
    kernels = native_kernels()
    isa = {} if kernels is None else {"fp32_fp16w": kernels.isa(), "int8_dot": kernels.int8_dot_isa(),
                                      "gguf_q8": kernels.gguf_q8_isa()}
    return Environment(
        torch=version("torch"),
        transformers=version("transformers"),  # metadata: the lazy module may lack __version__ after unpickling
        python=platform.python_version(), device=str(target.device), dtype=str(target.dtype),
        threads=torch.get_num_threads(), git_commit=code.commit, cpu=cpu.model_name, cpu_flags=cpu.flags,
        git_dirty=code.dirty, git_diff_sha256=code.diff_sha256, cascade=version("cascade"), cpu_vendor=cpu.vendor,
        cpu_family=cpu.family, cpu_model=cpu.model, cpu_stepping=cpu.stepping, native_isa=isa,
        native_unavailable=unavailable_reason(), target_kernels=linear_kernels(target.model),
        backends=backends_of([target, *models]),
    )


def backends_of(models: list) -> dict[str, str]:
    """Each loaded model's name -> its backend, the target first. A name loaded on several
    backends (the target on native and again on fp16w for a baseline method) keeps them all, in
    load order: "native, fp16w"."""
    backends: dict[str, list[str]] = {}
    for lm in models:
        names = backends.setdefault(lm.name, [])
        if str(lm.backend) not in names:
            names.append(str(lm.backend))
    return {name: ", ".join(b) for name, b in backends.items()}


def _refuse_dirty_results(out_dir: Path, allow: bool) -> None:
    """``results/`` holds what the docs cite: a run from uncommitted code may not write there
    (its commit would not pin its code) unless ``allow_dirty=true``; ``outputs/`` takes anything."""
    repo = Path(__file__).resolve().parents[1]
    try:
        inside = out_dir.resolve().is_relative_to(repo / "results")
    except OSError:
        inside = False
    if inside and not allow:
        code = code_state(repo)
        if code.dirty:
            raise ConfigError(f"{out_dir} is under results/ but the checkout has uncommitted changes (diff "
                              f"{code.diff_sha256}): commit first, or write under outputs/ (allow_dirty=true forces it)")


def _output_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or "outputs/run")


def _fmt(x, spec: str = "{:.2f}x") -> str:
    return "-" if x is None else spec.format(x)


def _with_retokenization(info: DrafterInfo) -> list[DrafterInfo]:
    """The cross-tokenizer drafters inside a method (``DrafterInfo.retokenization``)."""
    own = [info] if info.retokenization is not None and info.retokenization.drafts else []
    return own + [d for p in info.parts for d in _with_retokenization(p)]


def _table(results: dict[str, MethodSummary], predicted: bool = False) -> str:
    """alpha: a chain's acceptance; a tree's (accepted path / nodes) is shown as `tree 0.xxx`.
    speedup: tok/s of whole calls (prefill included) over the baseline's; decode: the same without
    the prefills; decomposed: the in-sample per-depth decomposition; predicted / measured: the second half of
    the prompts, predicted from the first half; same: greedy outputs identical to the baseline's."""
    rate = "pred tok/s" if predicted else "tok/s"
    lines = [f"{'method':16s} {'tau':>6s} {'alpha':>10s} {rate:>8s} {'speedup':>8s} {'decode':>7s} {'decomposed':>10s} "
             f"{'2nd half: predicted':>19s} {'measured':>8s} {'same':>5s}"]
    for name, r in results.items():
        s = r.stats
        alpha = "-" if s.alpha is None else f"{s.alpha:.3f}"
        if s.tree_acceptance is not None:
            alpha = f"tree {s.tree_acceptance:.3f}"
        h = r.heldout
        predicted = None if h is None else h.predicted_speedup
        same = "-" if r.identical_to_baseline is None else f"{r.identical_to_baseline}/{len(r.tokens)}"
        lines.append(f"{name:16s} {_fmt(s.tau, '{:.2f}'):>6s} {alpha:>10s} {s.tokens_per_s:8.2f} {r.speedup:7.2f}x "
                     f"{_fmt(r.decode_speedup):>7s} "
                     f"{_fmt(r.decomposition.decomposed_speedup_per_depth):>10s} {_fmt(predicted):>19s} "
                     f"{_fmt(h.measured_speedup if predicted is not None else None):>8s} {same:>5s}")
        for level, lv in s.levels.items():
            if lv.alpha is not None:
                lines.append(f"  level {level}: alpha {lv.alpha:.3f}, c {_fmt(lv.c, '{:.3f}')}")
        for drafter, tv in s.tree_by_drafter.items():
            lines.append(f"  tree drafter {drafter}: {tv.nodes_per_step:.2f} nodes/step, on the path {tv.accepted:.3f}, "
                         f"c {_fmt(tv.c, '{:.3f}')}")
        for info in _with_retokenization(r.drafter):
            rt = info.retokenization
            lines.append(f"  re-tokenization {info.name}: {rt.drafted} drafted -> {rt.proposed} proposed, text lost "
                         f"{_fmt(rt.lost_bytes_frac, '{:.1%}')}, drafter mass on shared tokens {_fmt(rt.mean_shared_mass, '{:.3f}')}")
        if r.by_category and name != BASELINE:
            lines.append("  by category (tau, speedup): " + ", ".join(
                f"{c} {_fmt(v.tau, '{:.2f}')} {v.speedup:.2f}x" for c, v in r.by_category.items()))
        for d in r.divergences:
            lines.append(f"  diverges from {BASELINE} on {d.prompt} at token {d.position} (target's top-2 gap {_fmt(d.top2_gap, '{:.4f}')})")
    return "\n".join(lines)


def run(cfg: DictConfig) -> RunSummary:
    """Run one experiment; returns the summary that is also written to ``summary.json``."""
    sampling = validate(cfg)
    out_dir = _output_dir(cfg)
    if (out_dir / "summary.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"{out_dir / 'summary.json'} exists: refusing to mix runs (pass overwrite=true)")
    _refuse_dirty_results(out_dir, cfg.get("allow_dirty", False))
    ds = cfg.dataset
    prompt_set = load_prompts(ds.name, ds.num_prompts, ds.path, ds.field, ds.get("per_category", 3))  # before any model loads
    check_reserve(prompt_set, method_configs(cfg))
    torch.set_num_threads(cfg.threads)

    m = cfg.models
    with shared_models() as loaded:  # methods naming the same model share one copy
        target = load_model(m.target, m.backend, m.device)
        methods = {name: build_method(mcfg, verify_rule(cfg, mcfg)) for name, mcfg in method_configs(cfg).items()}
    env = _environment(target, list(loaded.values()))  # before decoding: the code and kernels the numbers come from
    env.peers = {name: method.info for name, method in methods.items() if isinstance(method, LlamaCppGenerate)}
    prompts = [encode(target, p, ds.chat_template) for p in prompt_set]
    log.info("%d prompts, methods %s, target %s", len(prompts), list(methods), m.target)

    device = cfg.get("device_model")
    gens = decode_interleaved(target, methods, prompts, ds.max_new_tokens, sampling, warmup=cfg.warmup,
                              progress=cfg.progress, seed=cfg.seed, device=device)
    results = summarize_methods(target, methods, prompt_set, prompts, gens, sampling)
    clock = next(iter(gens.values()))[0].clock
    shapes = {name: shape for g in gens.values() for gen in g for name, shape in gen.forward_shapes.items()}
    summary = RunSummary(experiment=cfg.experiment_name, config=OmegaConf.to_container(cfg, resolve=True),
                         environment=env, baseline=BASELINE, methods=results, clock=clock, forward_shapes=shapes)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(
        out_dir / "steps.jsonl",
        ({"method": n, "prompt": p.id, **s.to_dict()} for n, g in gens.items() for p, gen in zip(prompt_set, g) for s in gen.steps),
    )
    write_json_atomic(out_dir / "summary.json", summary.to_dict())  # last: its presence marks a complete run
    print(env.header())
    if clock != "measured":
        print(f"# PREDICTED, not measured: every time, tok/s and speedup below is a virtual clock's ({clock}; "
              "roofline: cascade/costs.py); the tokens are real")
    print(_table(results, predicted=clock != "measured"))
    log.info("results in %s", out_dir)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
