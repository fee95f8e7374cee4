"""Real redis-server processes for tests: a shared session fixture and a controllable instance.

``redis_server`` (session scope) starts one server on a free port in a temp dir and yields
its URL. ``RedisInstance`` starts separate servers that fault tests may stop, pause
(SIGSTOP), resume and restart on the same port. ``RedisClusterProcs`` starts a 3-master
Redis Cluster (``--cluster-enabled yes`` + ``redis-cli --cluster create``); ``SentinelGroup``
a master, a replica and 1..3 ``redis-sentinel`` processes. A missing redis-server (or
redis-sentinel) is a test FAILURE, not a skip: CI installs them (Debian packages
``redis-server``, ``redis-sentinel``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loadtest.free_ports import free_ports

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """The redis-server executable, or fail the test with how to get it."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if found is None:
        pytest.fail(
            "redis-server is not installed (not on PATH, not at /usr/bin/redis-server). "
            "The Redis store tests need a real server: install it, e.g. `apt-get install redis-server`.",
            pytrace=False,
        )
    return found


def free_port() -> int:
    """Below the ephemeral range: no outgoing connection takes it before redis-server binds."""
    return free_ports(1)


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without tearing down."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisInstance:
    """One redis-server process on 127.0.0.1; the port is kept across stop/start."""

    def __init__(
        self, workdir: Path | None = None, port: int | None = None, extra: list[str] | None = None
    ) -> None:
        self.extra = list(extra or [])
        self._own_dir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="kvroute-redis-")) if workdir is None else workdir
        )
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.workdir / "redis.log", "ab") as log:
            return subprocess.Popen(
                [
                    redis_server_binary(),
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.workdir),
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--loglevel", "warning",
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip

    def _launch(self, deadline: float) -> bool:
        """Start the process and wait for PING; False if it exited (port taken) or timed out."""
        self.proc = self._spawn()
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _pings(self.port):
                return True
            time.sleep(0.02)
        self._kill()
        return False

    def _fail(self, what: str) -> None:
        log = self.workdir / "redis.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"redis-server {what} (port {self.port}); log tail:\n{tail}", pytrace=False)

    def start(self) -> RedisInstance:
        """Start on a free port (another one if the port was taken meanwhile)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for _attempt in range(3):
            if self._launch(deadline):
                return self
            self.port = free_port()
        self._fail(f"did not answer PING within {START_TIMEOUT_S}s")
        return self

    def restart(self) -> RedisInstance:
        """Stop and start again on the same port (an empty server: nothing is persisted)."""
        self.stop()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._launch(deadline):
                return self
            time.sleep(0.1)  # the port may be held briefly after the old process exits
        self._fail("did not come back on its port")
        return self

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def stop(self) -> None:
        self._kill()

    def close(self) -> None:
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisInstance:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server for the whole test session; yields its URL (database 0)."""
    instance = RedisInstance(tmp_path_factory.mktemp("redis"))
    instance.start()
    try:
        yield instance.url
    finally:
        instance.close()


# --------------------------------------------------------------------------- HA topologies
def _binary(name: str, package: str) -> str:
    found = shutil.which(name) or (
        f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None
    )
    if found is None:
        pytest.fail(f"{name} is not installed: `apt-get install {package}`", pytrace=False)
    return found


def _command(port: int, *args: str, timeout: float = 5.0) -> str:
    """redis-cli against one port; its stdout (our own servers only, so no auth)."""
    cli = _binary("redis-cli", "redis-tools")
    out = subprocess.run(
        [cli, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout


def _wait(what: str, check: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    pytest.fail(f"{what} within {timeout}s", pytrace=False)


class RedisClusterProcs:
    """A Redis Cluster of ``masters`` primaries and no replicas on 127.0.0.1.

    The node timeout is short so that a test run never waits on cluster gossip for long.
    """

    def __init__(self, masters: int = 3) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-cluster-"))
        self.nodes: list[RedisInstance] = []
        for i in range(masters):
            d = self.workdir / f"n{i}"
            d.mkdir()
            self.nodes.append(
                RedisInstance(
                    d,
                    extra=[
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "2000",
                    ],
                )
            )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterProcs:
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cli = _binary("redis-cli", "redis-tools")
        out = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode != 0:
            pytest.fail(
                f"redis-cli --cluster create failed: {out.stdout[-1500:]}{out.stderr[-500:]}"
            )
        _wait(
            "cluster_state:ok on every node",
            lambda: all(
                "cluster_state:ok" in _command(n.port, "cluster", "info") for n in self.nodes
            ),
        )
        return self

    def flushall(self) -> None:
        for n in self.nodes:
            _command(n.port, "flushall")

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class SentinelGroup:
    """A master, one replica and ``sentinels`` redis-sentinel processes watching ``name``.

    Quorum is a majority of the sentinels; down-after is short (``down_after_ms``) so that a
    failover test measures kvroute's behaviour, not a default 30 s detection delay.
    """

    def __init__(self, sentinels: int = 1, name: str = "kvroute", down_after_ms: int = 500) -> None:
        self.name = name
        self.down_after_ms = down_after_ms
        self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-sentinel-"))
        (self.workdir / "master").mkdir()
        (self.workdir / "replica").mkdir()
        self.master = RedisInstance(self.workdir / "master")
        self.replica = RedisInstance(self.workdir / "replica")
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_procs: list[subprocess.Popen[bytes]] = []

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.sentinel_ports]

    def _sentinel_conf(self, i: int, port: int) -> Path:
        quorum = len(self.sentinel_ports) // 2 + 1
        conf = self.workdir / f"sentinel-{i}.conf"
        conf.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.workdir}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} {quorum}\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.name} 5000\n"
            f"sentinel parallel-syncs {self.name} 1\n"
        )
        return conf

    def start(self) -> SentinelGroup:
        self.master.start()
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        _wait(
            "the replica in sync with the master",
            lambda: "master_link_status:up" in _command(self.replica.port, "info", "replication"),
        )
        binary = _binary("redis-sentinel", "redis-sentinel")
        for i, port in enumerate(self.sentinel_ports):
            conf = self._sentinel_conf(i, port)
            with open(self.workdir / f"sentinel-{i}.log", "ab") as log:
                self.sentinel_procs.append(
                    subprocess.Popen(
                        [binary, str(conf)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        preexec_fn=_die_with_parent,
                    )
                )
        for port in self.sentinel_ports:
            _wait(f"sentinel on {port} sees the replica", lambda p=port: self._sees_replica(p))
        return self

    def _sees_replica(self, port: int) -> bool:
        out = _command(port, "sentinel", "replicas", self.name)
        return str(self.replica.port) in out

    def master_port(self) -> int:
        out = _command(self.sentinel_ports[0], "sentinel", "get-master-addr-by-name", self.name)
        lines = out.split()
        return int(lines[1]) if len(lines) >= 2 else -1

    def kill_master(self) -> None:
        """Stop the current master for good (SIGTERM): the sentinels promote the replica."""
        self.master.stop()

    def close(self) -> None:
        for proc in self.sentinel_procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        self.master.close()
        self.replica.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    """A 3-master Redis Cluster for the whole session (started on first use)."""
    cluster = RedisClusterProcs(3)
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelGroup]:
    """Master + replica + one sentinel for the whole session (tests must not kill its master)."""
    group = SentinelGroup(sentinels=1)
    try:
        yield group.start()
    finally:
        group.close()
