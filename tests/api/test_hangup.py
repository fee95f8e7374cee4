"""SIGHUP means "the terminal is gone" in the foreground of a terminal, "reload" under a supervisor.

Black box: the real ``kvroute serve`` process; its terminal is a real pseudo-terminal
(``pty.openpty``) given as its stdin, as a shell would; "under a supervisor" is no terminal
at all, as under systemd or Kubernetes.
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.local_fleet import EngineSpec, free_port, gateway_config, wait_http
from proxy.api.hangup import attached_to_terminal, hup_reloads
from tests.support.gateway import wait_until


@pytest.fixture
def start_serve(tmp_path: Path, engine_factory: Any) -> Iterator[Any]:
    """``start(*flags, terminal=bool) -> (popen, url, config_path)``."""
    engine = engine_factory()
    started: list[subprocess.Popen[bytes]] = []
    terminals: list[int] = []

    def start(*flags: str, terminal: bool) -> tuple[subprocess.Popen[bytes], str, Path]:
        cfg = tmp_path / "kvroute.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config([(EngineSpec("b0"), engine.url)])))
        port = free_port()
        argv = [
            sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg),
            "--host", "127.0.0.1", "--port", str(port), *flags,
        ]  # fmt: skip
        stdin: Any = subprocess.DEVNULL
        if terminal:
            controller, stdin = pty.openpty()
            terminals.extend((controller, stdin))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        log = (tmp_path / f"serve-{port}.log").open("wb")
        popen = subprocess.Popen(argv, stdin=stdin, stdout=log, stderr=log, env=env)
        started.append(popen)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", timeout_s=60, proc=popen)
        return popen, url, cfg

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    for fd in terminals:
        os.close(fd)


def _generation(url: str) -> int:
    return int(httpx.get(url + "/fleet", timeout=10).json()["config"]["generation"])


def _edit(cfg: Path) -> None:
    data = yaml.safe_load(cfg.read_text())
    data.setdefault("routing", {})["long_threshold_tokens"] = 12_345
    cfg.write_text(yaml.safe_dump(data))


def test_in_the_foreground_of_a_terminal_a_hangup_stops_the_gateway(start_serve: Any) -> None:
    popen, _, _ = start_serve(terminal=True)
    popen.send_signal(signal.SIGHUP)
    # Before: SIGHUP reloaded, and the gateway outlived its terminal.
    assert popen.wait(timeout=60) == 0


@pytest.mark.parametrize(
    ("flags", "terminal"), [(("--reload-on-hup",), True), ((), False)], ids=["flag", "no-terminal"]
)
def test_with_the_flag_or_without_a_terminal_a_hangup_reloads(
    start_serve: Any, flags: tuple[str, ...], terminal: bool
) -> None:
    popen, url, cfg = start_serve(*flags, terminal=terminal)
    assert _generation(url) == 1
    _edit(cfg)
    popen.send_signal(signal.SIGHUP)
    wait_until(lambda: _generation(url) == 2, timeout_s=30, what="the reload")
    assert popen.poll() is None


def test_stop_on_hup_stops_without_a_terminal(start_serve: Any) -> None:
    popen, _, _ = start_serve("--stop-on-hup", terminal=False)
    popen.send_signal(signal.SIGHUP)
    assert popen.wait(timeout=60) == 0


def test_the_choice() -> None:
    assert hup_reloads(True) and not hup_reloads(False)
    controller, terminal = pty.openpty()
    read_end, write_end = os.pipe()
    try:
        assert attached_to_terminal([terminal])
        assert not attached_to_terminal([read_end, write_end])
        # A closed descriptor is no terminal (a daemon may run with 0-2 closed).
        assert not attached_to_terminal([10_000])
    finally:
        for fd in (controller, terminal, read_end, write_end):
            os.close(fd)
