"""A busy port is one clear line and a non-zero exit, before anything claims to be ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_gateway_on_a_busy_port(busy_port: int) -> None:
    res = run("serve", "--config", str(ROOT / "config" / "kvroute.yaml"), "--port", str(busy_port))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert f"port {busy_port} is in use" in res.stderr
    assert "ready" not in out and "Traceback" not in out


def test_engine_on_a_busy_port(busy_port: int) -> None:
    res = run("engine", "--port", str(busy_port))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert f"port {busy_port} is in use" in res.stderr
    assert "listening" not in out and "Traceback" not in out


def test_engine_ready_line_reads_well() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "engine", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(30)
    # The URL ends the line (tests and scripts read the port from it).
    assert line.startswith("kvroute engine (name: engine) listening on http://127.0.0.1:")
