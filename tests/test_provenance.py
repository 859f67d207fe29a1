"""Run provenance: the code state (commit, dirty flag, diff hash), the CPU's identity and the
kernels a model's linears run on, in every summary and the run table's header."""

import subprocess

import pytest

from torch import nn

import cascade.run as run_mod
from cascade.provenance import code_state, cpu_identity, linear_kernels
from tests.test_experiments import _cfg

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse avx2 fma f16c avx512f avx512_vnni avx512_bf16 sha_ni

processor\t: 1
vendor_id\t: SomethingElse
"""


def test_cpu_identity_reads_the_first_processor():
    cpu = cpu_identity(CPUINFO)
    assert (cpu.vendor, cpu.model_name, cpu.family, cpu.model, cpu.stepping) == ("AuthenticAMD", "AMD EPYC", 26, 2, 1)
    assert cpu.flags == ["avx2", "avx512_bf16", "avx512_vnni", "avx512f", "f16c", "fma"]  # kernel-selecting flags only
    assert cpu.label() == "AMD EPYC (family 26 model 2 stepping 1)"
    assert cpu_identity("").vendor is None


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_code_state_flags_and_hashes_a_dirty_tree(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "cascade").mkdir()
    (tmp_path / "README.md").write_text("docs\n")
    (tmp_path / "cascade" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "cascade/a.py", "README.md")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=t", "commit", "-qm", "one")
    clean = code_state(tmp_path)
    assert len(clean.commit) == 40 and clean.dirty is False and clean.diff_sha256 is None
    (tmp_path / "README.md").write_text("other docs\n")
    assert code_state(tmp_path).dirty is False  # docs do not change what a run computes
    (tmp_path / "cascade" / "a.py").write_text("x = 2\n")
    first = code_state(tmp_path)
    (tmp_path / "cascade" / "a.py").write_text("x = 3\n")
    second = code_state(tmp_path / "cascade")
    assert first.dirty and second.dirty and first.commit == clean.commit
    assert first.diff_sha256 and second.diff_sha256 and first.diff_sha256 != second.diff_sha256


def test_linear_kernels_counts_classes():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3))
    assert linear_kernels(model) == {"Linear": 2}


def test_summary_and_header_carry_provenance(tmp_path, capsys):
    cfg = _cfg("+experiment=ar", "debug=tiny", f"output_dir={tmp_path}", "progress=false")
    env = run_mod.run(cfg).environment
    cpu = cpu_identity()
    assert env.cpu_vendor == cpu.vendor and env.cpu_family == cpu.family and env.cpu_model == cpu.model
    assert env.cpu_stepping == cpu.stepping and env.cpu_flags == cpu.flags
    assert env.cascade and env.threads >= 1 and sum(env.target_kernels.values()) > 0
    assert env.native_isa or env.native_unavailable  # which kernels, or why none
    assert env.backends == {"tiny:0": "float32"}  # debug=tiny: the target on float32, no drafter
    code = code_state()
    assert env.git_commit == code.commit and env.git_dirty == code.dirty and env.git_diff_sha256 == code.diff_sha256
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("# commit ") and f"family {env.cpu_family}" in header and "backends: tiny:0 float32" in header
    assert ("DIRTY (diff " + str(env.git_diff_sha256)) in header if env.git_dirty else "DIRTY" not in header


def test_every_loaded_models_backend_is_recorded(tmp_path):
    cfg = _cfg("+experiment=sps", "debug=tiny", f"output_dir={tmp_path}", "progress=false")
    assert run_mod.run(cfg).environment.backends == {"tiny:0": "float32", "tiny:1": "float32"}


def test_a_model_loaded_on_two_backends_keeps_both():
    """The target on native and again on fp16w (a baseline method): neither entry overwrites the other."""
    from types import SimpleNamespace as M

    loaded = [M(name="t", backend="native"), M(name="d[int4_vnni]", backend="int4_vnni"), M(name="t", backend="fp16w"),
              M(name="t", backend="native")]
    assert run_mod.backends_of(loaded) == {"t": "native, fp16w", "d[int4_vnni]": "int4_vnni"}


def test_a_dirty_checkout_may_not_write_under_results(tmp_path, monkeypatch):
    """results/ holds what the docs cite: uncommitted code is refused there, before any model loads."""
    import cascade.provenance as prov

    monkeypatch.setattr(run_mod, "code_state", lambda repo=None: prov.CodeState("abc", True, "feedbeef"))
    target = run_mod.Path(run_mod.__file__).resolve().parents[1] / "results" / "never_written"
    loaded = []
    monkeypatch.setattr(run_mod, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(run_mod.ConfigError, match="uncommitted changes .diff feedbeef"):
        run_mod.run(_cfg("+experiment=ar", "debug=tiny", f"output_dir={target}"))
    assert not loaded and not target.exists()
    run_mod._refuse_dirty_results(tmp_path, allow=False)  # anywhere else: fine
    run_mod._refuse_dirty_results(target, allow=True)  # forced
