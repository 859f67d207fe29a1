"""analysis/: gathering result trees (with a malformed file and a missing job), every figure
writes a non-empty image with the expected axes, and the trace-replay simulator is exact where
the record allows (replaying a recorded greedy chain at shorter draft lengths reproduces real
runs of those lengths token for token)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import cascade.run as run_mod
from analysis import figures
from analysis.gather import GatherError, load_jobs, table
from analysis.plot_ewif import main as plot_ewif_main
from analysis.simulate import replay, trace_from_job

CONF = Path(__file__).resolve().parents[1] / "conf"


def _run(out: Path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    run_mod.run(cfg)
    (out / ".hydra").mkdir(exist_ok=True)
    (out / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([o for o in overrides if not o.startswith(("output_dir", "progress"))]))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A fake multirun: layer-skip chains (exit 3 of the 4-layer target: an exact drafter) with k = 1, 2, 3 on the tiny debug models."""
    root = tmp_path_factory.mktemp("sweep")
    for i, k in enumerate((1, 2, 3)):
        job = root / f"{i}_k{k}"
        _run(job, "+experiment=layer_skip", "debug=tiny", "models.exits.shallow=3", f"method.drafter.k={k}", "dataset.max_new_tokens=24",
             "dataset.num_prompts=3", f"output_dir={job}", "progress=false", "warmup=false")
    return root


def test_table_has_swept_parameters_and_reports_missing_jobs(sweep, tmp_path):
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    (root / "3_k4" / ".hydra").mkdir(parents=True)  # a job that never finished
    df, incomplete = table(root)
    assert len(df) == 6 and set(df["method"]) == {"ar", "layer_skip"}
    assert sorted(df[df.method == "layer_skip"]["method.drafter.k"].astype(int)) == [1, 2, 3]
    assert (df[df.method == "ar"]["speedup"] == 1.0).all()
    assert incomplete == [root / "3_k4"]


def test_malformed_files_are_named(sweep, tmp_path):
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    bad = root / "1_k2" / "summary.json"
    bad.write_text("{not json")
    with pytest.raises(GatherError, match=r"1_k2/summary.json: not valid JSON"):
        table(root)
    bad.write_text(json.dumps({"methods": {}}))
    with pytest.raises(GatherError, match="malformed summary.*missing field 'experiment'"):
        table(root)
    shutil.copytree(sweep / "1_k2", root / "1_k2", dirs_exist_ok=True)
    steps = root / "0_k1" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    steps.write_text("\n".join(lines[:2] + ["{oops"] + lines[2:]))
    job = next(j for j in load_jobs(root)[0] if j.dir.name == "0_k1")
    with pytest.raises(GatherError, match=r"steps.jsonl:3"):
        job.steps()


def _check_image(paths):
    assert {p.suffix for p in paths} == {".png", ".pdf"}
    assert all(p.stat().st_size > 1000 for p in paths)


def test_each_figure_writes_an_image_with_its_axes(tmp_path):
    fig, paths = figures.ewif_curves([{"gamma": 2, "speedup": 1.3, "lo": 1.2, "hi": 1.4}], 0.7, 0.2, "t", tmp_path,
                                     verify=lambda g: 1 + 0.1 * g)
    _check_image(paths)
    ax = fig.axes[0]
    assert "draft length" in ax.get_xlabel() and "speedup" in ax.get_ylabel()
    assert any("optimal" in t.get_text() for t in ax.get_legend().get_texts())
    fig, paths = figures.ewif_two_level_map(0.7, 0.5, 0.3, 0.01, "t", tmp_path, points=[{"n": 2, "k": 3, "speedup": 1.1}])
    _check_image(paths)
    assert "rounds" in fig.axes[0].get_xlabel() and "tokens" in fig.axes[0].get_ylabel()
    fig, paths = figures.alpha_by_depth({"a": [0.8, 0.7], "b": [0.5]}, "t", tmp_path)
    _check_image(paths)
    assert "depth" in fig.axes[0].get_xlabel() and len(fig.axes[0].lines) == 2
    fig, paths = figures.tau_histogram({"a": [1, 2, 3, 3], "b": [1, 1, 2]}, "t", tmp_path)
    _check_image(paths)
    assert "τ" in fig.axes[0].get_xlabel()
    fig, paths = figures.speedup_bars({"ar": 1.0, "sps": 1.3, "tree": 1.6}, "t", tmp_path)
    _check_image(paths)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["autoregressive", "sps", "tree"]
    steps = [{"nodes": n, "accepted": 1, "estimates": {"alpha": {"0:lm": {"depth1": {"mean": 0.5 + 0.01 * n}}},
                                                      "forward_curve_s": {"0:lm": {"1": 0.012, "3": 0.016}},
                                                      "drafter_cost_s": {"1:ngram": 1e-4}, "verify_curve_s": {"1": 0.11, "4": 0.14}}}
             for n in (3, 5, 8)]
    fig, paths = figures.tree_trajectories(steps, "t", tmp_path)
    _check_image(paths)
    assert [a.get_ylabel().split(" ")[0] for a in fig.axes] == ["α̂", "ĉ", "nodes"]
    assert len(fig.axes[1].lines) == 2  # the LM drafter's forward and the lookup
    assert [l.get_label() for l in fig.axes[0].lines] == ["0:lm"]  # α̂ at depth 1, per drafter


def test_plot_ewif_on_a_sweep(sweep, tmp_path, capsys):
    assert plot_ewif_main([str(sweep), "--out", str(tmp_path / "figs")]) == 0
    names = {p.name for p in (tmp_path / "figs").iterdir()}
    assert {"ewif.png", "ewif.pdf", "alpha_by_depth.png", "tau_hist.png", "speedup.png"} <= names
    assert "pooled alpha" in capsys.readouterr().out


def test_replay_is_exact_where_the_record_allows(sweep):
    jobs = {j.dir.name: j for j in load_jobs(sweep)[0]}
    trace = trace_from_job(jobs["2_k3"])
    assert trace.exact_drafter
    # the recorded draft length: every round is read from the record, tau is reproduced exactly
    pred = replay(trace, 3, samples=3)
    assert pred["exact_share"] == 1.0
    assert pred["tau"] == pytest.approx(jobs["2_k3"].summary.methods["layer_skip"].tau, abs=1e-12)
    # shorter drafts: most rounds exact (the rest drawn from the record), tau close to real runs
    for name, gamma in (("1_k2", 2), ("0_k1", 1)):
        real = jobs[name].summary.methods["layer_skip"]
        pred = replay(trace, gamma, samples=20)
        assert pred["exact_share"] > 0.6, name
        assert abs(pred["tau"] - real.tau) / real.tau < 0.1, (name, pred["tau"], real.tau)


def test_replay_refuses_what_it_cannot_replay(tmp_path):
    job = tmp_path / "csd"
    _run(job, "+experiment=csd_two_level", "debug=tiny", f"output_dir={job}", "progress=false", "warmup=false")
    with pytest.raises(GatherError, match="single-drafter chain"):
        trace_from_job(load_jobs(job)[0][0])


def test_per_category_columns_and_figure(tmp_path, capsys):
    """A prompt set with categories gives speedup[CATEGORY] / tau[CATEGORY] columns, and the
    speedup-by-category figure draws one bar per method and category."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ab ab ab", "category": "code"}\n{"prompt": "xyz", "category": "chat"}\n')
    job = tmp_path / "sweep" / "0_x"
    _run(job, "+experiment=token_recycling", "debug=tiny", "dataset.name=jsonl", f"dataset.path={prompts}", "dataset.num_prompts=null",
         "dataset.max_new_tokens=8", f"output_dir={job}", "progress=false")
    from analysis.markdown import main as markdown_main

    capsys.readouterr()  # (the run's own printout)
    assert markdown_main([str(job), "--by-category"]) == 0  # the docs' per-category table
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| method | code | chat | overall | decode | τ |" and lines[2].startswith("| ar | 1.00 | 1.00 | 1.00x |")
    df, _ = table(tmp_path / "sweep")
    row = df[df.method == "token_recycling"].iloc[0]
    assert {"speedup[code]", "speedup[chat]", "tau[code]", "tau[chat]"} <= set(df.columns)
    assert row["tau[code]"] >= 1.0 and (df[df.method == "ar"]["speedup[chat]"] == 1.0).all()
    fig, paths = figures.speedup_by_category({"a": [1.2, 0.9, 1.0], "b": [1.1, 1.3, 1.2]}, ["code", "chat", "overall"], "t", tmp_path)
    _check_image(paths)
    ax = fig.axes[0]
    assert len(ax.patches) == 6 and [t.get_text() for t in ax.get_xticklabels()] == ["code", "chat", "overall"]


def test_plot_run_draws_a_multi_method_run(tmp_path, capsys):
    """analysis.plot_run on one benchmark run: speedup bars over every method with their range
    across prompts, and the DyTC tree's trajectories from steps.jsonl."""
    from analysis.plot_run import main as plot_run_main

    job = tmp_path / "tree"
    _run(job, "+experiment=bench/tree", "debug=tiny", f"output_dir={job}", "progress=false", "warmup=false")
    assert plot_run_main([str(job), "--out", str(tmp_path / "figs")]) == 0
    names = {p.name for p in (tmp_path / "figs").iterdir()}
    assert {"speedup_bench_tree_builtin.png", "tree_trajectories_dytc_builtin.png"} <= names
    assert not any(n.startswith("tree_trajectories_static") for n in names)  # only the priced tree
    for stem in ("speedup_bench_tree_builtin", "tree_trajectories_dytc_builtin"):
        _check_image([tmp_path / "figs" / f"{stem}.png", tmp_path / "figs" / f"{stem}.pdf"])


def test_round_decomposition_adds_up(sweep, capsys):
    """analysis.rounds: per method, verify + draft + accept + other is the mean step time, the
    baseline's round is one step, and a chain's rounds hold its drafted inputs."""
    import json as _json

    from analysis.rounds import main as rounds_main, round_parts

    job = sweep / "2_k3"
    steps = [_json.loads(line) for line in (job / "steps.jsonl").read_text().splitlines()]
    parts = round_parts(steps)
    for name, p in parts.items():
        mine = [s for s in steps if s["method"] == name]
        total = sum(s["step_time_s"] for s in mine) / len(mine)
        assert p["verify"] + p["draft"] + p["accept"] + p["other"] == pytest.approx(total)
    assert parts["ar"]["inputs"] == 1 and parts["layer_skip"]["inputs"] > 1
    assert rounds_main([str(job)]) == 0
    out = capsys.readouterr().out
    assert "one autoregressive step" in out and " 1.000 " in out.splitlines()[2]
    assert "sibling" in out


def test_draft_shape_counts_first_children_and_siblings():
    """A round's tree: node 0 and its sibling 1 below the root, node 2 below 0; the path 0 -> 2
    accepted. First children: 0 (of the root) and 2 (of 0), both accepted; sibling 1, rejected."""
    from analysis.rounds import draft_shape

    tree = {"method": "t", "drafted": 3, "parents": [-1, -1, 0], "accepted_path": [0, 2]}
    chain = {"method": "c", "drafted": 3, "parents": [-1, 0, 1], "accepted_path": [0]}
    shape = draft_shape([tree, chain, {"method": "ar", "drafted": 0, "parents": [], "accepted_path": []}])
    assert "ar" not in shape
    assert shape["t"] == {"rounds": 1, "nodes": 3, "depth": 2, "first": 2, "first_accepted": 1.0,
                          "siblings": 1, "siblings_accepted": 0.0}
    assert shape["c"]["first"] == 3 and shape["c"]["first_accepted"] == pytest.approx(1 / 3)
    assert shape["c"]["siblings"] == 0 and shape["c"]["depth"] == 3


def test_round_parts_per_mode_split_a_policys_rounds_by_what_it_drafted():
    """analysis.rounds' per-mode table: a policy's rounds keyed by the mode it recorded (chain /
    tree), each mode's means over its own rounds; rounds of methods that record no mode left out."""
    from analysis.rounds import mode_of, round_parts

    def step(method, shape, emitted, target_s):
        return {"method": method, "emitted": emitted, "drafted": 3, "target_time_s": target_s, "draft_time_s": 0.1,
                "step_time_s": target_s + 0.1, "tree": {"shape": shape} if shape else None}

    steps = [step("d", "chain", 4, 0.2), step("d", "tree", 2, 0.4), step("d", "chain", 2, 0.4), step("c", None, 4, 0.2)]
    modes = round_parts(steps, key=mode_of)
    assert set(modes) == {"d [chain]", "d [tree]"}
    assert modes["d [chain]"]["rounds"] == 2 and modes["d [chain]"]["tokens"] == 3
    assert modes["d [chain]"]["verify"] == pytest.approx(0.3) and modes["d [tree]"]["verify"] == pytest.approx(0.4)
    assert round_parts(steps)["d"]["rounds"] == 3


def test_markdown_table_of_a_run(sweep, capsys):
    """analysis.markdown: one row per method, the baseline at 1.00x with no range, a chain's τ,
    α and whole-call speedup as the summary holds them, greedy equality counted per prompt."""
    from analysis.markdown import main as markdown_main

    job = sweep / "2_k3"
    summary = json.loads((job / "summary.json").read_text())
    capsys.readouterr()
    assert markdown_main([str(job)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["| ar", "| layer_skip"]
    ls = summary["methods"]["layer_skip"]
    assert rows[0][6:8] == ["1.00x", "-"] and rows[1][1] == f"{ls['stats']['tau']:.2f}"
    assert rows[1][6] == f"{ls['speedup']:.2f}x" and rows[1][8] == "3/3 |"
    with pytest.raises(SystemExit, match="not the mixed set"):
        markdown_main([str(job), "--by-category"])
    # without every prompt but one: the speedups over that prompt alone
    prompts = list(summary["methods"]["ar"]["tokens_per_s_by_prompt"])
    assert markdown_main([str(job), *sum((["--without", p] for p in prompts[1:]), [])]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    one = ls["tokens_per_s_by_prompt"][prompts[0]] / summary["methods"]["ar"]["tokens_per_s_by_prompt"][prompts[0]]
    assert rows[0][1:] == ["1.00x", "1.00x |"] and rows[1][1] == f"{one:.2f}x"
    with pytest.raises(SystemExit, match="no such prompts"):
        markdown_main([str(job), "--without", "nope"])
    # the caption: the command that made the run, its commit and cleanliness, the CPU and backends
    assert markdown_main([str(job), "--caption"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    env = summary["environment"]
    assert first.startswith("`python -m cascade.run ") and "k=3" in first.split("`")[1]
    assert f"`{env['git_commit'][:7]}`" in first and ("DIRTY" if env["git_dirty"] else "clean") in first
    assert f"family {env['cpu_family']} model {env['cpu_model']}" in first and "tiny:0 float32" in first
    # two runs side by side: each method's τ, nodes, decode and whole-call speedups of both
    assert markdown_main([str(job), "--pair", str(sweep / "1_k2")]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    other = json.loads((sweep / "1_k2" / "summary.json").read_text())["methods"]["layer_skip"]
    assert rows[1][0] == "| layer_skip" and rows[1][1] == f"{ls['stats']['tau']:.2f} / {other['stats']['tau']:.2f}"
    assert rows[1][5:7] == [f"{ls['speedup']:.2f}x", f"{other['speedup']:.2f}x"]
