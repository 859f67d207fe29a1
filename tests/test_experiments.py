"""Hydra experiments: every conf/experiment/*.yaml composes and runs with debug=tiny; sweeps;
bad configs fail before any model is loaded."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

import cascade.run as run_mod
from cascade.results import gather
from cascade.summary import RunSummary

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
BENCHMARKS = sorted(f"bench/{p.stem}" for p in (CONF / "experiment" / "bench").glob("*.yaml"))
# Experiments whose method is not implemented yet must fail with a clear message; remove a
# name from here when its method lands (the test then fails until it is removed).
NOT_YET_AVAILABLE: set[str] = set()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_experiments_are_found():
    assert {"ar", "sps", "pld", "csd_two_level"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_runs_with_tiny_models(name, tmp_path):
    cfg = _cfg(f"+experiment={name}", "debug=tiny", f"output_dir={tmp_path}", "progress=false")
    assert cfg.experiment_name == name
    if name in NOT_YET_AVAILABLE:
        with pytest.raises(run_mod.ConfigError, match="not yet available"):
            run_mod.run(cfg)
        return
    summary = run_mod.run(cfg)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert RunSummary.from_dict(on_disk) == summary  # written and read back as the same types
    method = summary.methods[cfg.method.name]
    assert method.tau >= 1 and method.tokens_per_s > 0 and method.decomposition is not None
    assert summary.methods["ar"].speedup == 1.0
    held = method.heldout  # debug=tiny has 2 prompts: the second predicted from the first
    assert held.fit_prompts == 1 and held.test_prompts == 1 and held.measured_speedup > 0
    info = method.drafter  # what the method is, from Drafter.describe
    assert info.kind != "drafter" and isinstance(info.budget, int) and info.name
    assert summary.methods["ar"].drafter.kind == "autoregressive"
    assert summary.environment.torch and summary.config["experiment_name"] == name
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert {s["method"] for s in steps} == set(summary.methods)
    # greedy: the method's tokens equal the baseline's, prompt by prompt
    assert method.tokens == summary.methods["ar"].tokens
    assert method.identical_to_baseline == len(method.tokens) and not method.divergences


def test_benchmarks_are_found():
    assert {"bench/core", "bench/cascade", "bench/tree", "bench/drafters", "bench/categories", "bench/ewif"} <= set(BENCHMARKS)


def _cpu_has_vnni() -> bool:
    from cascade.models.backends.native import native_kernels

    return native_kernels() is not None and native_kernels().has_vnni()


@pytest.mark.parametrize("name", [b for b in BENCHMARKS if b != "bench/ewif"])
def test_every_benchmark_runs_its_methods_interleaved_with_tiny_models(name, tmp_path):
    """A benchmark experiment runs >= 3 methods beside the baseline in one process and writes one
    summary with a row per method; under greedy decoding every method of cascade's own loop emits
    exactly the baseline's tokens (float32 tiny models; transformers' generate on a stock bf16
    copy may round a near-tie differently, and says where). A benchmark that samples (bench/verify)
    runs greedy here (temperature 0), where its methods must equal the baseline too; test_verify_rules_benchmark
    runs it sampled."""
    extra = []
    if name == "bench/kernels" and not _cpu_has_vnni():  # as its config says: int8_vnni needs AVX-512 VNNI
        extra = ["~methods.chain_int8v"]
    if name == "bench/gguf":  # its methods on the tiny models' own backend (no GGUF file); llama.cpp's need its server
        extra = ["models.backend=float32", "models.drafter_backend=float32",
                 *[f"~methods.{m}" for m in ("llamacpp_ar", "llamacpp_spec_n3", "llamacpp_spec_n8", "llamacpp_ngram")]]
    cfg = _cfg(f"+experiment={name}", "debug=tiny", f"output_dir={tmp_path}", "progress=false", "sampling=greedy",
               "sampling.temperature=0.0", *extra)
    summary = run_mod.run(cfg)
    assert len(summary.compared) >= 3 and set(summary.methods) == {"ar", *cfg.methods}
    steps = {json.loads(line)["method"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()}
    for method_name, m in summary.compared.items():
        if m.drafter.kind.startswith("transformers_generate"):
            assert method_name not in steps and m.tau is None and m.tokens_per_s > 0
            if cfg.methods[method_name].generate.model is None:  # the run's own float32 modules
                assert m.tokens == summary.methods["ar"].tokens, method_name
            continue
        assert method_name in steps and m.tau >= 1.0
        assert m.tokens == summary.methods["ar"].tokens, method_name
        assert m.identical_to_baseline == len(m.tokens) and not m.divergences


def test_benchmark_sweep_over_one_methods_parameter_is_gathered(tmp_path):
    """`-m` with two values of one method's parameter: two complete jobs, each with every method,
    gathered by `python -m cascade.results`."""
    sweep = tmp_path / "sweep"
    result = _cli("-m", "+experiment=bench/cascade", "debug=tiny", "methods.chain.drafter.k=2,3",
                  f"hydra.sweep.dir={sweep}", "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows, incomplete = gather(sweep)
    assert not incomplete and len({r["dir"] for r in rows}) == 2
    assert sorted(r["methods.chain.drafter.k"] for r in rows if r["method"] == "chain") == ["2", "3"]
    assert {r["method"] for r in rows} == {"ar", "chain", "csd", "csd_three", "csd_horizontal"}
    listed = _cli_results(sweep)
    assert listed.returncode == 0 and listed.stdout.count("method=chain") == 2


def _cli_results(path):
    return subprocess.run([sys.executable, "-m", "cascade.results", str(path)], capture_output=True, text=True, timeout=120)


def test_a_method_named_ar_is_refused(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=bench/cascade", "debug=tiny", "+methods.ar={name: x, drafter: {_target_: cascade.drafters.NGramDrafter}}",
               f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match="baseline"):
        run_mod.run(cfg)


def test_bad_sampling_is_refused_before_loading(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=pld", "sampling=sample", "sampling.top_p=1.5", f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match="top_p"):
        run_mod.run(cfg)


def test_unavailable_method_class_is_reported(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=pld", "method.drafter._target_=cascade.drafters.NotYetWritten", f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match="NotYetWritten, which is not yet available"):
        run_mod.run(cfg)


def test_rerun_into_same_directory_is_refused(tmp_path):
    cfg = _cfg("+experiment=pld", "debug=tiny", f"output_dir={tmp_path}", "progress=false")
    run_mod.run(cfg)
    before = (tmp_path / "summary.json").read_text()
    with pytest.raises(FileExistsError, match="refusing to mix runs"):
        run_mod.run(cfg)
    assert (tmp_path / "summary.json").read_text() == before


def test_unknown_experiment():
    with pytest.raises(HydraException, match="experiment/nope"):
        _cfg("+experiment=nope")


def test_misspelled_key():
    with pytest.raises(HydraException, match="metod"):
        _cfg("+experiment=sps", "metod.k=3")


def test_missing_required_value(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=pld", "dataset=jsonl", f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match="missing required value.*dataset.path"):
        run_mod.run(cfg)


def test_dataset_file_missing(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=pld", "dataset=jsonl", f"dataset.path={tmp_path}/absent.jsonl", f"output_dir={tmp_path}")
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        run_mod.run(cfg)


def test_dataset_malformed_line(no_model_loading, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    cfg = _cfg("+experiment=pld", "dataset=jsonl", f"dataset.path={path}", f"output_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"p.jsonl:3: malformed JSON"):
        run_mod.run(cfg)


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "cascade.run", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_multirun_sweep_gives_one_directory_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "+experiment=sps", "debug=tiny", "method.drafter.k=1,2", f"hydra.sweep.dir={sweep}", "progress=false"]
    first = _cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    ks = sorted(RunSummary.from_dict(json.loads(p.read_text())).methods["sps"].drafter.budget for p in summaries)
    assert ks == [1, 2]
    rows, incomplete = gather(sweep)
    assert sorted(r["method.drafter.k"] for r in rows if r["method"] == "sps") == ["1", "2"] and not incomplete
    before = {p: p.read_text() for p in summaries}
    second = _cli(*args, cwd=tmp_path)  # same sweep directory: refused, first sweep intact
    assert second.returncode != 0 and "refusing to mix runs" in second.stderr
    assert {p: p.read_text() for p in summaries} == before


def test_job_dirname_keeps_short_names_and_hashes_long_ones():
    from cascade.dirnames import DIRNAME_CHARS, job_dirname

    assert job_dirname("dataset=gsm8k,seed=1") == "dataset=gsm8k,seed=1"
    long = ",".join(f"~methods.method_{i}=null" for i in range(20))
    name = job_dirname(long)
    assert len(name.encode()) <= DIRNAME_CHARS and name.startswith("~methods.method_0=null")
    assert job_dirname(long) == name and job_dirname(long + ",seed=2") != name  # stable, and distinct


def test_multirun_with_a_long_override_list_names_short_directories(tmp_path):
    """Hydra names a job directory after its overrides; past the file system's 255 bytes every job
    failed with "File name too long". Long names are cut and hashed (cascade.dirnames.job_dirname)."""
    sweep = tmp_path / "sweep"
    tag = "x" * 300
    result = _cli("-m", "+experiment=pld", "debug=tiny", "seed=1,2", f"+tag={tag}", f"hydra.sweep.dir={sweep}",
                  "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert len(jobs) == 2 and all(len(j.name) < 130 for j in jobs) and jobs[0].name != jobs[1].name
    rows, incomplete = gather(sweep)
    assert sorted({r["seed"] for r in rows}) == ["1", "2"] and not incomplete


def test_submitit_launcher_local_executor(tmp_path):
    sweep = tmp_path / "sweep"
    result = _cli(
        "-m", "+experiment=pld", "debug=tiny", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
        "seed=1,2", f"hydra.sweep.dir={sweep}", "progress=false", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list(sweep.glob("*/summary.json"))) == 2


@pytest.mark.parametrize("launcher", ["basic", "local_parallel"])
def test_resume_launches_only_incomplete_jobs(launcher, tmp_path):
    """A job that died (no summary.json) is reported, and the same command with resume=true
    launches only it; complete jobs are not launched and their files are not touched. The default
    sweep directory holds a timestamp, so resume finds the earlier sweep with the same overrides."""
    args = ["-m", "+experiment=pld", "debug=tiny", "seed=1,2,3", f"hydra/launcher={launcher}", "progress=false"]
    first = _cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun" / "pld").iterdir()
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 3
    (jobs[1] / "summary.json").unlink()  # as if job 1 had been killed before writing its summary
    kept = {j: [(p, p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(j.rglob("*")) if p.is_file()] for j in (jobs[0], jobs[2])}
    time.sleep(1.1)  # a re-run names a new timestamped directory: resume must find this one
    second = _cli(*args, "resume=true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    said = second.stdout + second.stderr
    assert f"resume: sweep multirun/pld/{sweep.name}" in said and "job #0 is complete, not launched" in said and "job #2 is complete" in said
    assert (jobs[1] / "summary.json").is_file()
    for job, files in kept.items():  # untouched, byte for byte and mtime
        assert [(p, p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(job.rglob("*")) if p.is_file()] == files
    assert [p.name for p in (tmp_path / "multirun" / "pld").iterdir()] == [sweep.name]
    rows, incomplete = gather(sweep)
    assert len({r["dir"] for r in rows}) == 3 and not incomplete
    assert all("resume" not in r for r in rows)


def test_resume_without_an_earlier_sweep_is_refused(tmp_path):
    result = _cli("-m", "+experiment=pld", "debug=tiny", "seed=1,2", "resume=true", cwd=tmp_path)
    assert result.returncode != 0 and "no earlier sweep" in result.stderr


def test_verify_rules_benchmark_samples_with_each_methods_rule(tmp_path):
    """bench/verify under its own sampling: each method's rule is the one it names (the run's
    ``verify`` otherwise), and every method decodes every prompt."""
    from cascade.verify import accept_block, accept_sampled, accept_traversal

    cfg = _cfg("+experiment=bench/verify", "debug=tiny", f"output_dir={tmp_path}", "progress=false")
    rules = {n: run_mod.verify_rule(cfg, m) for n, m in run_mod.method_configs(cfg).items()}
    assert rules == {"ar": "token", "chain_token": "token", "chain_block": "block", "reranked_token": "token",
                     "reranked_traversal": "traversal", "dytc_token": "token", "dytc_traversal": "traversal"}
    built = {n: run_mod.build_method(m, rules[n]) for n, m in run_mod.method_configs(cfg).items()}
    assert built["chain_block"].verifier.sampled is accept_block
    assert built["dytc_traversal"].verifier.sampled is accept_traversal
    assert built["chain_token"].verifier.sampled is accept_sampled
    summary = run_mod.run(cfg)
    assert not summary.methods["chain_block"].drafter.kind.startswith("tree")
    for name, m in summary.compared.items():  # every prompt decoded (EOS may end one early)
        assert len(m.tokens) == len(summary.methods["ar"].tokens) and all(1 <= len(t) <= cfg.dataset.max_new_tokens
                                                                for t in m.tokens.values()), name


def test_a_cascades_inner_rounds_follow_its_methods_rule():
    from hydra.utils import instantiate

    from cascade.verify import accept_block, accept_traversal

    cfg = _cfg("+experiment=csd_three_level", "debug=tiny", "verify=block")
    cascade_drafter = instantiate(cfg.method.drafter)
    assert cascade_drafter.verifier.sampled is accept_block
    assert cascade_drafter.lower.verifier.sampled is accept_block  # the nested level
    cfg = _cfg("+experiment=bench/cascade", "debug=tiny", "verify=block", "methods.csd.verify=traversal")
    assert instantiate(cfg.methods.csd.drafter).verifier.sampled is accept_traversal
    assert instantiate(cfg.methods.csd_three.drafter).verifier.sampled is accept_block


def test_unknown_verification_rule_is_refused_before_loading(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=sps", "verify=blockwise", f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match="unknown verification rule 'blockwise'"):
        run_mod.run(cfg)


def test_block_verification_refuses_a_tree_method(tmp_path):
    cfg = _cfg("+experiment=static_tree", "debug=tiny", "sampling=sample", "verify=block", f"output_dir={tmp_path}",
               "progress=false")
    with pytest.raises(ValueError, match="drafts token trees.*verify=traversal"):
        run_mod.run(cfg)


def test_interleaved_methods_rotate_their_order_per_prompt():
    """No method keeps one place in each prompt's sequence (a late place ran slower on a shared
    host): prompt i starts with the i-th method; each method still sees every prompt once."""
    from cascade.evaluate import decode_interleaved

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def decode(self, target, ids, max_new_tokens, sampling, seed, clock):
            calls.append((self.name, ids[0], seed))
            return self.name

    methods = {n: Recorder(n) for n in ("ar", "a", "b")}
    gens = decode_interleaved(None, methods, [[10], [11], [12], [13]], 4, None, warmup=False, progress=False, seed=5)
    assert [c[0] for c in calls] == ["ar", "a", "b", "a", "b", "ar", "b", "ar", "a", "ar", "a", "b"]
    assert all(seed == 5 + prompt - 10 for _, prompt, seed in calls)  # prompt i keeps seed + i whatever the order
    assert gens == {n: [n] * 4 for n in methods}
