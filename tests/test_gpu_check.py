"""scripts/gpu_check.sh: the one-command device check. The default suite runs it on tiny models
on the CPU (every step, the same code paths but the device), so it cannot rot; ``-m gpu`` runs the
real one where CUDA is present."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["1. greedy equality", "2. deep chi-square", "3. quantized drafter", "4. forward cost", "5. the main job",
         "6. the h100 roofline"]


def _run(tmp_path, *args, timeout):
    out = tmp_path / "report.md"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "PYTHON": sys.executable})
    return proc, out


def test_gpu_check_tiny_runs_every_step(tmp_path):
    proc, out = _run(tmp_path, "--tiny", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    for step in STEPS:
        assert f"## {step}" in report and report.split(f"## {step}")[1].split("\n")[0].count("passed") == 1, step
    assert "Failed: none" in report and "Command: `bash scripts/gpu_check.sh --tiny`" in report


def test_gpu_check_without_cuda_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc, _ = _run(tmp_path, timeout=60)
    assert proc.returncode == 2 and "--tiny" in proc.stderr


@pytest.mark.gpu
def test_gpu_check_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    proc, out = _run(tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Failed: none" in out.read_text()


def test_forward_cost_check_fails_on_broken_shapes():
    """The forward-cost step is falsifiable: a batched forward costing k one-token forwards, or a
    4-token forward far off the bandwidth-bound roofline, is reported."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_check import forward_cost_problems

    assert forward_cost_problems({1: 0.010, 4: 0.011, 16: 0.020, 32: 0.035}) == []
    assert forward_cost_problems({1: 0.010, 4: 0.025, 16: 0.030, 32: 0.040})  # 4 inputs at 2.5x one
    assert forward_cost_problems({1: 0.010, 4: 0.012, 16: 0.30, 32: 0.50})  # worse than sequential forwards
    assert forward_cost_problems({1: 0.0, 4: 0.01, 16: 0.02, 32: 0.03})


def test_main_job_check_fails_on_a_divergence(tmp_path):
    """The main-job step reads the summary: a greedy method that left the baseline's tokens away
    from a near-tie fails it; the tiny main job as it ran passes."""
    import json

    from hydra import compose, initialize_config_dir

    import cascade.run as run_mod

    sys.path.insert(0, str(ROOT / "experiments"))
    from gpu_check import main_job_problems

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=csd_two_level", "debug=tiny",
                                                       f"output_dir={tmp_path}", "progress=false"])
    run_mod.run(cfg)
    path = tmp_path / "summary.json"
    assert main_job_problems(path, near_tie=1e-3) == []
    data = json.loads(path.read_text())
    method = data["methods"]["csd_two_level"]
    method["identical_to_baseline"] -= 1
    method["divergences"] = [{"prompt": "p0", "position": 3, "top2_gap": 2.5}]
    path.write_text(json.dumps(data))
    problems = main_job_problems(path, near_tie=1e-3)
    assert len(problems) == 1 and "csd_two_level" in problems[0]
    method["divergences"][0]["top2_gap"] = 1e-5  # at a near-tie: allowed
    path.write_text(json.dumps(data))
    assert main_job_problems(path, near_tie=1e-3) == []
    assert main_job_problems(tmp_path / "absent.json", near_tie=1e-3)
