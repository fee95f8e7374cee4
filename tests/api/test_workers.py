"""``kvroute serve --workers N``: N real gateway processes on one port, sharing Redis.

Black box: the real CLI, real trivial engines, a real redis-server. Which worker accepted a
connection is read from /proc (each worker listens on its own SO_REUSEPORT socket).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from loadtest.bench.overhead_load import CHAT_PATH, MODEL, request_body
from loadtest.local_fleet import EngineSpec, Proc, free_port, gateway_config, wait_http
from proxy.api.workers import Restarts
from tests.support.redis_server import RedisInstance


def _serve(cfg_path: Path, port: int, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg_path),
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
        "--log-level", "warning",
    ]  # fmt: skip


@pytest.fixture
def trivial_engine(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.engine.trivial", "--port", str(port), "--model", MODEL]
    p = Proc("trivial", argv, f"http://127.0.0.1:{port}")
    p.start(log_dir=tmp_path)
    try:
        wait_http(p.url + "/health", proc=p.popen)
        yield p.url
    finally:
        p.stop()


def _config(tmp_path: Path, engine_url: str, redis_url: str | None) -> Path:
    overrides = {"store": {"redis_url": redis_url, "leases": True}} if redis_url else {}
    path = tmp_path / "kvroute.yaml"
    data = gateway_config([(EngineSpec("b0"), engine_url)], **overrides)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_more_than_one_worker_with_the_embedded_store_is_refused(
    tmp_path: Path, trivial_engine: str
) -> None:
    cfg = _config(tmp_path, trivial_engine, None)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    done = subprocess.run(_serve(cfg, port, 2), capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert "--workers 2" in done.stderr and "Redis" in done.stderr
    assert "store.redis_url" in done.stderr
    # Nothing was started: the port is still free.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in found]


def _established_on(pid: int, port: int) -> int:
    """Established TCP connections accepted on ``port`` held by process ``pid``."""
    inodes: set[str] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local_port = int(cols[1].split(":")[1], 16)
        if local_port == port and cols[3] == "01" and cols[9] in inodes:
            n += 1
    return n


def test_two_workers_share_one_port_and_redis(tmp_path: Path, trivial_engine: str) -> None:
    redis = RedisInstance().start()
    port = free_port()
    proc = Proc("gateway", _serve(_config(tmp_path, trivial_engine, redis.url), port, 2), "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc.start(env=env, log_dir=tmp_path)
    url = f"http://127.0.0.1:{port}"
    clients: list[httpx.Client] = []
    try:
        assert proc.popen is not None
        deadline = time.monotonic() + 60
        while len(_children(proc.popen.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(proc.popen.pid)
        assert len(workers) == 2
        # Every worker must answer before the kernel's spread can be checked.
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        # Fresh connections, each kept open: the kernel spreads them over both workers.
        for _ in range(24):
            c = httpx.Client(base_url=url, timeout=10.0)
            clients.append(c)
            r = c.post(
                CHAT_PATH, content=request_body(False), headers={"content-type": "application/json"}
            )
            assert r.status_code == 200, r.text
        held = [_established_on(w, port) for w in workers]
        assert sum(held) == 24
        assert all(h > 0 for h in held), held
        # Both workers reserve and release in the one Redis: nothing stays reserved.
        time.sleep(0.5)
        import redis as redis_lib

        r = redis_lib.Redis.from_url(redis.url)
        leftovers = [k for k in r.scan_iter("*res*") if r.hlen(k)]
        assert leftovers == []
    finally:
        for c in clients:
            c.close()
        proc.stop()
        redis.stop()
    # Stopping the supervisor stopped its workers too.
    for w in workers:
        assert not Path(f"/proc/{w}").exists() or "zombie" in Path(f"/proc/{w}/status").read_text()


def test_a_worker_killed_by_a_signal_is_restarted_and_its_lease_lapses(
    tmp_path: Path, trivial_engine: str
) -> None:
    """SIGKILL one of two workers (as the OOM killer would): the supervisor starts another in
    its place, under a new lease, and the killed one's lease lapses within store.lease_ttl_s."""
    redis = RedisInstance().start()
    port = free_port()
    proc = Proc("gateway", _serve(_config(tmp_path, trivial_engine, redis.url), port, 2), "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc.start(env=env, log_dir=tmp_path)
    url = f"http://127.0.0.1:{port}"

    def live() -> set[str]:
        return set(httpx.get(url + "/fleet", timeout=5).json()["replicas"]["live"])

    def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
                if check():
                    return
            time.sleep(0.1)
        raise AssertionError(f"not within {timeout_s} s: {what}")

    try:
        assert proc.popen is not None
        wait_for("two workers with live leases", lambda: len(live()) == 2)
        before = live()
        workers = _children(proc.popen.pid)
        os.kill(workers[0], signal.SIGKILL)
        wait_for(
            "a new worker in the killed one's place",
            lambda: len(set(_children(proc.popen.pid)) - set(workers)) == 1,  # type: ignore[union-attr]
            30,
        )
        assert proc.alive, "the supervisor must outlive a worker killed by a signal"
        # The new worker's lease joins; the killed one's lapses (5 s TTL, renewed every 1.7 s).
        wait_for("the killed worker's lease to lapse", lambda: len(live() - before) == 1, 30)
        wait_for("two live leases again", lambda: len(live()) == 2 and live() != before, 10)
    finally:
        proc.stop()
        redis.stop()


def test_restarts_are_for_signals_and_bounded() -> None:
    budget = Restarts(limit=2, window_s=60.0)
    assert not budget.allow(0, 0.0) and not budget.allow(1, 0.0)  # exited by itself
    assert budget.allow(-signal.SIGKILL, 1.0) and budget.allow(-signal.SIGSEGV, 2.0)
    assert not budget.allow(-signal.SIGKILL, 3.0)  # a crash loop: the set stops
    assert budget.allow(-signal.SIGKILL, 62.0)  # the first death left the window
