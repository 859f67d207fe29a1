"""The native build never hangs: a lock left by a killed build is removed (ours and torch's), a
live holder is waited for at most the timeout, and a timed-out build falls back with its reason."""

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cascade.models.backends.build_lock import LOCK_NAME, TORCH_LOCK_NAME, BuildLockTimeout, build_lock


def _lock_of(pid: int) -> str:
    return f"{pid} {socket.gethostname()}\n"


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, caplog):
    # a process takes the lock the way a build does, and is killed holding it (SIGKILL: no cleanup)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from cascade.models.backends.build_lock import build_lock
        with build_lock(pathlib.Path({str(tmp_path)!r})):
            (pathlib.Path({str(tmp_path)!r}) / {TORCH_LOCK_NAME!r}).write_text("")  # torch's baton, mid-build
            print("held", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    assert (tmp_path / LOCK_NAME).exists() and (tmp_path / TORCH_LOCK_NAME).exists()

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="cascade.models.backends.build_lock"):
        with build_lock(tmp_path, timeout_s=5):
            assert not (tmp_path / TORCH_LOCK_NAME).exists(), "torch's stale lock would hang its own loader"
            assert (tmp_path / LOCK_NAME).read_text() == _lock_of(os.getpid())
    assert time.monotonic() - start < 2
    assert not (tmp_path / LOCK_NAME).exists()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "stale build lock" in said and str(holder.pid) in said and "torch's build lock" in said


def test_a_live_holder_is_waited_for_at_most_the_timeout(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(_lock_of(sleeper.pid))
        start = time.monotonic()
        with pytest.raises(BuildLockTimeout, match=f"held by \\({sleeper.pid}"):
            with build_lock(tmp_path, timeout_s=1.0):
                pass
        assert 1.0 <= time.monotonic() - start < 3.0
        assert (tmp_path / LOCK_NAME).exists(), "a live holder's lock is not ours to remove"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_released_while_waiting_is_taken(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / LOCK_NAME).write_text(_lock_of(sleeper.pid))
    sleeper.kill()  # the holder dies while we wait
    sleeper.wait()
    with build_lock(tmp_path, timeout_s=5):
        assert (tmp_path / LOCK_NAME).read_text() == _lock_of(os.getpid())


def test_a_build_that_cannot_take_the_lock_falls_back_with_the_reason(tmp_path):
    """End to end in a fresh process: the native extension's build directory is locked by a live
    process (this test's); the loader gives up after CASCADE_BUILD_TIMEOUT and says why."""
    script = textwrap.dedent(f"""
        import os, socket
        from cascade.models.backends import native
        from cascade.models.backends.build_lock import LOCK_NAME
        d = native._build_dir(); d.mkdir(parents=True, exist_ok=True)
        (d / LOCK_NAME).write_text(f"{{os.getppid()}} {{socket.gethostname()}}\\n")
        print(native.unavailable_reason())
    """)
    env = {**os.environ, "CASCADE_CACHE": str(tmp_path), "CASCADE_BUILD_TIMEOUT": "1", "CASCADE_NATIVE": "1"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "BuildLockTimeout" in out.stdout and "held by" in out.stdout
    assert time.monotonic() - start < 60
