"""What made a result: the code (commit, dirty flag, a hash of the uncommitted diff), the CPU
(vendor, model name, family / model / stepping, the flags that select kernels) and the kernels
each model's linear layers run on. Pure reads of the machine and the repository; written into
every ``summary.json`` (``cascade.summary.Environment``) and printed in the run table's header."""

from __future__ import annotations

import hashlib
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from cascade.costs import is_linear

# the /proc/cpuinfo flags that decide which kernels run (cascade/models/backends/native.py, FBGEMM, oneDNN)
KERNEL_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c")


# what a run's numbers depend on: a change elsewhere (docs, results, tests) leaves a run's code clean
CODE_PATHS = ("cascade", "conf", "hydra_plugins", "analysis", "experiments", "pyproject.toml")


@dataclass
class CodeState:
    commit: str | None  # git HEAD (None outside a checkout)
    dirty: bool | None  # uncommitted changes to tracked files under CODE_PATHS
    diff_sha256: str | None = None  # sha256 of `git diff HEAD -- CODE_PATHS` when dirty (what the run's code differs by)


@dataclass
class CpuIdentity:
    vendor: str | None = None
    model_name: str | None = None
    family: int | None = None
    model: int | None = None
    stepping: int | None = None
    flags: list[str] = field(default_factory=list)  # the kernel-selecting flags, sorted

    def label(self) -> str:
        """One line: 'AMD EPYC (family 26 model 2 stepping 1)'."""
        return f"{self.model_name} (family {self.family} model {self.model} stepping {self.stepping})"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, check=True).stdout


def code_state(repo: Path | None = None) -> CodeState:
    """The checkout's commit and whether (and by what) its code (``CODE_PATHS``) differs from it."""
    cwd = repo or Path(__file__).resolve().parent
    try:
        commit = _git("rev-parse", "HEAD", cwd=cwd).strip()
        top = Path(_git("rev-parse", "--show-toplevel", cwd=cwd).strip())
        diff = _git("diff", "HEAD", "--binary", "--", *CODE_PATHS, cwd=top)
    except (OSError, subprocess.CalledProcessError):
        return CodeState(None, None)
    dirty = bool(diff)
    return CodeState(commit, dirty, hashlib.sha256(diff.encode()).hexdigest()[:16] if dirty else None)


def cpu_identity(cpuinfo: str | None = None) -> CpuIdentity:
    """Parsed from /proc/cpuinfo (Linux; empty elsewhere). ``cpuinfo`` is the text, for tests."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return CpuIdentity()
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        return int(first[key]) if first.get(key, "").isdigit() else None

    flags = sorted(f for f in first.get("flags", "").split() if f.startswith(KERNEL_FLAG_PREFIXES))
    return CpuIdentity(first.get("vendor_id"), first.get("model name"), number("cpu family"), number("model"),
                       number("stepping"), flags)


def linear_kernels(model: nn.Module) -> dict[str, int]:
    """How many linear layers run on each kernel class (e.g. {'NativeFP16Linear': 197, 'Linear': 1})."""
    counts = Counter(type(m).__name__ for m in model.modules() if is_linear(m))
    return dict(sorted(counts.items()))
