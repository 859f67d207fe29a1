"""A Hydra sweep on a real (one-node, local) SLURM cluster, a job killed mid-run, and a resume that
launches only that job (marker ``slurm``: ``python -m pytest -m slurm``; `.ci/run` runs it).

The cluster comes from ``scripts/slurm_local.sh`` (installs slurm-wlm and munge from Debian when
missing; needs root). The sweep command is what a user types on any cluster, with
``hydra/launcher=slurm`` and resource keys; nothing in cascade knows the cluster is local.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cascade.results import gather, load_jobs

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (apt-get install, system daemons)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and apt-get is not available to install it")
    out = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0 and "apt-get" in out.stderr:
        pytest.skip(f"could not install SLURM with apt-get: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, f"slurm_local.sh start failed:\n{out.stdout}\n{out.stderr}"
    print(out.stdout)
    yield


def _sweep_cmd(sweep: Path, *extra: str) -> list[str]:
    # SmolLM2-135M (the suite's real model; a tiny random model finishes before it can be killed):
    # jobs 0 and 1 decode a few tokens, job 2 enough to be killed while it decodes
    return [sys.executable, "-m", "cascade.run", "-m", "hydra/launcher=slurm", "+experiment=pld", "debug=tiny",
            "models.target=smollm2-135m", "dataset.max_new_tokens=4,8,64", "dataset.num_prompts=4", "threads=1",
            "progress=false", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}", *extra]


def _squeue() -> list[tuple[str, str, str]]:
    """(job id, state, name) of this user's SLURM jobs."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%j"], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]


def _summary(sweep: Path, num: int) -> Path:
    (job,) = [d for d in sweep.iterdir() if d.name.startswith(f"{num}_")] or [sweep / f"{num}_missing"]
    return job / "summary.json"


def test_killed_job_is_reported_and_resumed_alone(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(_sweep_cmd(sweep), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    # 1. wait until job 2 (the longest) is decoding, then kill it
    killed, deadline = None, time.time() + 240
    while killed is None:
        assert time.time() < deadline, f"timed out; squeue: {_squeue()}"
        assert driver.poll() is None, f"the sweep ended before a job could be killed:\n{driver.stdout.read()}"
        jobs = _squeue()
        running = [j for j in jobs if j[0].endswith("_2") and j[1] == "RUNNING"]
        # run() logs "N prompts, methods ..." once the model is loaded, right before decoding
        if running and any("prompts, methods" in log.read_text() for log in sweep.glob("2_*/run.log")):
            killed = running[0][0]
            print("squeue before the kill:", jobs)
            subprocess.run(["scancel", killed], check=True)
        time.sleep(0.2)
    log = driver.communicate(timeout=240)[0]
    print(log[-3000:])
    assert driver.returncode != 0  # the sweep fails: one job was killed
    assert "1 of 3 jobs are incomplete" in log and "resume=true" in log
    jobs, incomplete = load_jobs(sweep)
    print("after the kill: complete", [j.dir.name for j in jobs], "incomplete", [d.name for d in incomplete])
    assert not _summary(sweep, 2).exists()  # no half-written summary from the killed job
    assert not list(sweep.glob("2_*/*.tmp"))
    assert {j.dir.name.split("_")[0] for j in jobs} == {"0", "1"} and [d.name.split("_")[0] for d in incomplete] == ["2"]
    before = {n: (_summary(sweep, n).read_bytes(), _summary(sweep, n).stat().st_mtime_ns) for n in (0, 1)}

    # 2. the same command with resume=true: only job 2 is submitted; 0 and 1 are not touched
    submitted_before = {p for p in (sweep / ".submitit").iterdir() if not p.name.startswith(".")}  # one folder per SLURM job
    out = subprocess.run(_sweep_cmd(sweep, "resume=true"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(out.stdout[-2000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    new_submissions = {p for p in (sweep / ".submitit").iterdir() if not p.name.startswith(".")} - submitted_before
    print("resubmitted:", sorted(p.name for p in new_submissions))
    assert len(new_submissions) == 1  # one SLURM job (array of one task)
    said = out.stdout + out.stderr  # Hydra logs to stdout
    assert "job #0 is complete, not launched" in said and "job #1 is complete, not launched" in said
    for n in (0, 1):
        assert (_summary(sweep, n).read_bytes(), _summary(sweep, n).stat().st_mtime_ns) == before[n]
    assert _summary(sweep, 2).is_file()
    rows, incomplete = gather(sweep)
    assert not incomplete
    assert len({r["dir"] for r in rows}) == 3  # three complete jobs (each with its ar baseline and the method)
    assert sorted(int(r["dataset.max_new_tokens"]) for r in rows if r["method"] == "pld") == [4, 8, 64]
