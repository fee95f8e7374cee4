"""`kvroute local-fleet` starts exactly the engines a config expects (README's own-servers path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from loadtest.local_fleet import free_port, specs_from_config
from tests.support.gateway import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_config_gets_four_engines() -> None:
    wanted = specs_from_config(str(ROOT / "config" / "kvroute.yaml"), 10.0, 100_000)
    assert [port for _, port in wanted] == [8101, 8102, 8103, 8104]
    assert {spec.allocator for spec, _ in wanted} == {"contiguous"}
    assert [spec.pool for spec, _ in wanted] == ["long", "long", "general", "general"]


def test_local_fleet_serves_every_backend(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    cfg = tmp_path / "k.yaml"
    cfg.write_text(
        "pools: {general: {}, long: {role: long}}\n"
        "backends:\n"
        f"  - {{name: l0, url: 'http://127.0.0.1:{ports[0]}', pool: long, kind: contiguous}}\n"
        f"  - {{name: g0, url: 'http://127.0.0.1:{ports[1]}', kind: paged, capacity_tokens: 50000}}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "local-fleet", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:

        def metrics(port: int) -> str:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
            except httpx.HTTPError:
                return ""

        wait_until(lambda: all(metrics(p) for p in ports), timeout_s=30, what="engines up")
        assert 'allocator="contiguous"' in metrics(ports[0])
        g0 = metrics(ports[1])
        assert 'allocator="paged"' in g0 and "kvroute_engine_kv_capacity_tokens 50000" in g0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "ready: now run `kvroute serve --config" in out


def test_local_fleet_refuses_what_it_cannot_simulate(tmp_path: Path) -> None:
    cfg = tmp_path / "k.yaml"
    cfg.write_text("backends: [{name: v, url: 'http://127.0.0.1:9', kind: vllm}]\n")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "local-fleet", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "kind 'vllm'" in res.stderr


def test_readme_engine_commands_match_the_shipped_config() -> None:
    """The getting-started page's by-hand commands start exactly the engines config/kvroute.yaml expects."""
    import re

    readme = (ROOT / "docs" / "getting-started.md").read_text()
    section = readme.split("To run the gateway in front of servers", 1)[1].split("## Commands", 1)[
        0
    ]
    cmds = re.findall(
        r"kvroute engine --port (\d+) --name (\S+)\s+--allocator (\S+) --capacity-tokens (\d+) --speedup (\d+)",
        section,
    )
    wanted = specs_from_config(str(ROOT / "config" / "kvroute.yaml"), 10.0, 100_000)
    assert [(int(p), n, a) for p, n, a, _, _ in cmds] == [
        (port, spec.name, spec.allocator) for spec, port in wanted
    ]
    # Sped up, as local-fleet does: a real-time engine times long documents out.
    assert all(int(speed) >= 10 for *_, speed in cmds)
    assert "kvroute local-fleet --config config/kvroute.yaml" in section
