"""Start ``kvroute engine --behaviour vllm|sglang|tgi`` processes for end-to-end tests."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx


def start(behaviour: str, name: str, **flags: Any) -> tuple[subprocess.Popen[str], str]:
    """One engine process on a free port; flags are the CLI's, underscores for dashes."""
    argv = [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", behaviour]
    argv += ["--port", "0", "--name", name]
    for key, value in flags.items():
        # True: a switch without a value (``serial_prefill=True``).
        argv += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    # Its errors go to a file, read only if it dies at start (a pipe nobody reads could fill).
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.wait(timeout=10)
        errors.seek(0)
        raise AssertionError(f"engine {name} did not start: {line!r}; {errors.read()[-2000:]}")
    errors.close()
    return proc, line.split("listening on ", 1)[1].strip()


@contextmanager
def engines(*specs: tuple[str, str, dict[str, Any]]) -> Iterator[dict[str, str]]:
    """(behaviour, name, flags) each -> {name: url}; every process is stopped at the end."""
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for behaviour, name, flags in specs:
            proc, url = start(behaviour, name, **flags)
            stack.callback(_stop, proc)
            urls[name] = url
        yield urls


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def server_state(url: str) -> dict[str, Any]:
    """A simulated server's whole ``/admin/state``: its engines, held blocks, open rooms."""
    got: dict[str, Any] = httpx.get(url + "/admin/state", timeout=5).json()
    return got


def engine_state(url: str) -> list[dict[str, Any]]:
    """The engine's own ground truth, one entry per data-parallel engine."""
    engines_: list[dict[str, Any]] = server_state(url)["engines"]
    return engines_
