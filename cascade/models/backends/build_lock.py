"""A lock around building (or loading) a C++ extension, with a timeout and a stale-lock check.

Why ours: ``torch.utils.cpp_extension.load`` serialises builds with a lock file (``lock`` in the
build directory) whose waiter polls forever. A build killed by SIGKILL, OOM or a CI timeout
leaves that file behind, and every later process that loads the extension, even a cached build,
hangs without a word. Under :func:`build_lock` a process first takes ``cascade-build.lock`` (its
pid and host inside, created atomically); a lock whose holder on this host is gone is removed
with a warning, and so is torch's ``lock`` once ours is held (only a dead build can have left it:
every build of ours takes our lock first). Waiting for a live holder ends after ``timeout_s``
with :class:`BuildLockTimeout`, which the caller turns into its fallback and reason.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "cascade-build.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
DEFAULT_TIMEOUT_S = float(os.environ.get("CASCADE_BUILD_TIMEOUT", "900"))


class BuildLockTimeout(RuntimeError):
    """Another live process held the build lock for longer than the timeout."""


def _holder(path: Path) -> tuple[int, str] | None:
    """(pid, host) written in a lock file; None when it cannot be read (then it is not ours)."""
    try:
        pid, host = path.read_text().split(maxsplit=1)
        return int(pid), host.strip()
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _is_stale(path: Path) -> bool:
    """A lock of a process on this host that no longer runs (or a file that is not a lock of ours)."""
    holder = _holder(path)
    if holder is None:
        return True
    pid, host = holder
    return host == socket.gethostname() and not _alive(pid)


def _try_create(path: Path) -> bool:
    """Create ``path`` holding this process's pid and host, atomically (a complete file or none)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{os.getpid()} {socket.gethostname()}\n")
    try:
        os.link(tmp, path)  # fails if the lock exists; the lock is never seen half-written
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def build_lock(directory: Path, timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = 0.2):
    """Hold the build lock of ``directory`` for the body (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    deadline = time.monotonic() + timeout_s
    while not _try_create(path):
        if _is_stale(path):
            log.warning("removing a stale build lock %s (left by %s, which no longer runs)", path, _holder(path))
            path.unlink(missing_ok=True)
            continue
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(f"{path} is held by {_holder(path)} (still running) for more than {timeout_s:.0f} s; "
                                   f"wait for it, or raise CASCADE_BUILD_TIMEOUT")
        time.sleep(poll_s)
    try:
        torch_lock = directory / TORCH_LOCK_NAME
        if torch_lock.exists():
            log.warning("removing %s: torch's build lock left by a build that was killed (ours is held)", torch_lock)
            torch_lock.unlink(missing_ok=True)
        yield
    finally:
        path.unlink(missing_ok=True)
