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
STEPS = ["1. greedy equality", "2. deep chi-square", "3. quantized drafter", "4. forward cost", "5. the main job"]


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
