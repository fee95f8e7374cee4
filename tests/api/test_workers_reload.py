"""``kvroute serve --workers 2``: a reload reaches every worker, by SIGHUP or by the admin API.

Black box: the real CLI (a supervisor and two worker processes), a real redis-server, a
simulated engine. Each worker's config generation is read through its own Unix socket (in
the supervisor's private directory, made under the test's TMPDIR), so the test knows which
worker answered, which the shared TCP port cannot tell.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.local_fleet import EngineSpec, free_port, gateway_config, wait_http
from proxy.api.worker_peers import combined
from tests.support.gateway import wait_until
from tests.support.redis_server import RedisInstance

ADMIN = {"x-admin-key": "admin-secret"}


def _worker_sockets(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("kvroute-workers-*/worker-*.sock"))


def _generation(sock: Path) -> int:
    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, timeout=10) as client:
        return int(client.get("http://worker/fleet").json()["config"]["generation"])


def _generations(tmp: Path) -> list[int]:
    return [_generation(s) for s in _worker_sockets(tmp)]


def _answers(sock: Path) -> bool:
    try:
        _generation(sock)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture
def two_workers(
    tmp_path: Path, engine_factory: Any, request: pytest.FixtureRequest
) -> Iterator[tuple[Any, str, Path, Path]]:
    """A supervisor and 2 workers; ``indirect`` parameters are extra ``serve`` flags."""
    flags: tuple[str, ...] = getattr(request, "param", ())
    engine = engine_factory()
    redis = RedisInstance().start()
    cfg = tmp_path / "kvroute.yaml"
    data = gateway_config(
        [(EngineSpec("b0"), engine.url)],
        store={"redis_url": redis.url},
        admin={"api_key": ADMIN["x-admin-key"]},
    )
    cfg.write_text(yaml.safe_dump(data))
    port = free_port()
    # A Unix socket's path must stay short (108 bytes): pytest's tmp_path can be longer.
    sockets_tmp = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["TMPDIR"] = str(sockets_tmp)
    argv = [
        sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "2", *flags,
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("wb")
    # No terminal (stdin, stdout, stderr): SIGHUP means reload, as under a supervisor.
    popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", timeout_s=60, proc=popen)
        wait_until(
            lambda: (
                len(_worker_sockets(sockets_tmp)) == 2
                and all(_answers(s) for s in _worker_sockets(sockets_tmp))
            ),
            timeout_s=60,
            what="both workers on their sockets",
        )
        yield popen, url, cfg, sockets_tmp
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            popen.wait(60)
        redis.stop()
        shutil.rmtree(sockets_tmp, ignore_errors=True)


def _edit(cfg: Path, threshold: int) -> None:
    data = yaml.safe_load(cfg.read_text())
    data.setdefault("routing", {})["long_threshold_tokens"] = threshold
    cfg.write_text(yaml.safe_dump(data))


def test_sighup_to_the_supervisor_reloads_every_worker(
    two_workers: tuple[Any, str, Path, Path],
) -> None:
    popen, _, cfg, tmp = two_workers
    assert _generations(tmp) == [1, 1]
    _edit(cfg, 12_345)
    popen.send_signal(signal.SIGHUP)
    # Before: the supervisor died of the SIGHUP and left its workers on the old config.
    wait_until(lambda: _generations(tmp) == [2, 2], timeout_s=30, what="both workers reloaded")
    assert popen.poll() is None


def test_admin_reload_reaches_every_worker_and_reports_each(
    two_workers: tuple[Any, str, Path, Path],
) -> None:
    _, url, cfg, tmp = two_workers
    _edit(cfg, 23_456)
    r = httpx.post(url + "/admin/reload", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"] == "ok"
    pids = {s.stem.removeprefix("worker-") for s in _worker_sockets(tmp)}
    assert {w["worker"] for w in body["workers"]} == pids
    assert [w["result"] for w in body["workers"]] == ["ok", "ok"]
    assert all(w["generation"] == 2 for w in body["workers"])
    assert _generations(tmp) == [2, 2]
    # An invalid file: every worker refuses it and keeps its config; 422 says so.
    cfg.write_text(cfg.read_text() + "\nnot_a_section: 1\n")
    bad = httpx.post(url + "/admin/reload", headers=ADMIN, timeout=60)
    assert bad.status_code == 422, bad.text
    assert [w["result"] for w in bad.json()["workers"]] == ["invalid", "invalid"]
    assert _generations(tmp) == [2, 2]
    # Without the admin key, no worker reloads.
    assert httpx.post(url + "/admin/reload", timeout=30).status_code == 401


@pytest.mark.parametrize("two_workers", [("--stop-on-hup",)], indirect=True)
def test_with_stop_on_hup_a_hangup_stops_the_supervisor_and_its_workers(
    two_workers: tuple[Any, str, Path, Path],
) -> None:
    popen, _, _, tmp = two_workers
    workers = [int(s.stem.removeprefix("worker-")) for s in _worker_sockets(tmp)]
    popen.send_signal(signal.SIGHUP)
    assert popen.wait(timeout=60) == 0
    for pid in workers:
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()
    assert list(tmp.glob("kvroute-workers-*")) == []


def test_stopping_removes_the_workers_sockets(two_workers: tuple[Any, str, Path, Path]) -> None:
    popen, _, _, tmp = two_workers
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=60) == 0
    assert list(tmp.glob("kvroute-workers-*")) == []


@pytest.mark.parametrize(
    ("own", "others", "status", "result"),
    [
        ("ok", ["ok"], 200, "ok"),
        ("unchanged", ["ok"], 200, "mixed"),
        ("invalid", ["invalid"], 422, "invalid"),
        ("ok", ["unreachable"], 502, "mixed"),
        ("invalid", ["unreachable"], 502, "mixed"),
    ],
)
def test_the_combined_answer_reports_the_worst_worker(
    own: str, others: list[str], status: int, result: str
) -> None:
    body, code = combined({"result": own}, [{"worker": "2", "result": r} for r in others])
    assert code == status and body["result"] == result
    assert [w["result"] for w in body["workers"]] == [own, *others]
