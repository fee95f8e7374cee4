"""The fault soak's Redis: one plain server, or Sentinel (a primary, a replica, three sentinels).

``SingleRedis``: one ``redis-server``; its fault (``redis``) is a SIGKILL and a restart,
empty, on the same port 1.5 s later.

``SentinelRedis``: two ``redis-server`` (one the replica of the other) and three
``redis-sentinel`` watching them (quorum 2, down after 1 s). Its fault (``failover``): the
primary is SIGKILLed; the sentinels see it down and promote the replica; once they name the
new primary, the old one is started again as its replica (``--replicaof``) and the fault ends
when that replica is in sync, ready for the next failover. A SIGKILL rather than ``SENTINEL
FAILOVER``: a crash is what a failover is for, and it is the harder case (the gateways'
connections to the old primary break or hang, nothing is handed over, writes not yet
replicated are lost). The old primary comes back as a replica on purpose: started as a
primary, empty, it could answer clients before the sentinels turn it into a replica.

Both count what Redis itself holds: reservations not yet expired whose replica lease (if
they name one) still runs, on Redis's own clock, as the reserve script counts them.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import redis

from loadtest.local_fleet import Proc, free_port, redis_proc

SENTINEL_NAME = "kvroute-soak"
DOWN_AFTER_MS = 1000


def kill(p: Proc) -> None:
    p.signal(signal.SIGKILL)
    if p.popen is not None:
        p.popen.wait(10)


def wait_for(what: str, check: Any, timeout_s: float = 30.0) -> float:
    """Poll ``check()`` until true; the seconds it took, or TimeoutError naming ``what``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")


def live_reserved(client: redis.Redis, backends: Sequence[str], prefix: str = "kvroute") -> int:
    """Tokens Redis counts as reserved on ``backends``: unexpired, under a live lease (if any)."""
    secs, micros = client.time()
    now = secs + micros / 1e6
    total = 0
    for name in backends:
        res = client.hgetall(f"{prefix}:backend:{{{name}}}:res")
        leases = client.hgetall(f"{prefix}:backend:{{{name}}}:leases")
        for field, value in res.items():
            parts = str(value).split(" ")
            if str(field).startswith("~") or len(parts) != 3:
                continue  # a forget marker of an older version
            if float(parts[2]) <= now:
                continue
            _, at, lease = str(field).partition("@")
            if at and float(leases.get(lease, 0) or 0) <= now:
                continue
            total += int(parts[0])
    return total


class SoakRedis(Protocol):
    kind: str
    fault: str  # the name of its fault in the schedule

    def start(self, log_dir: Path) -> None: ...
    def store_config(self) -> dict[str, Any]: ...
    def client(self) -> redis.Redis: ...
    def inject(self) -> str: ...
    def stop(self) -> None: ...


class SingleRedis:
    kind = "single"
    fault = "redis"

    def __init__(self, workdir: Path) -> None:
        self.proc = redis_proc(workdir)
        self.log_dir = workdir

    def start(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proc.start(log_dir=log_dir)
        wait_for("redis up", lambda: self.client().ping(), 10)

    def store_config(self) -> dict[str, Any]:
        return {"redis_url": self.proc.url}

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.proc.url, decode_responses=True, socket_timeout=2)

    def inject(self) -> str:
        """SIGKILL, and the same port again 1.5 s later, empty."""
        kill(self.proc)
        time.sleep(1.5)
        self.proc.popen = None
        self.proc.start(log_dir=self.log_dir)
        took = wait_for("redis back", lambda: self.client().ping(), 10)
        return f"back empty {1.5 + took:.1f} s after the kill"

    def stop(self) -> None:
        self.proc.stop()


class SentinelRedis:
    kind = "sentinel"
    fault = "failover"

    def __init__(self, workdir: Path, sentinels: int = 3) -> None:
        self.workdir = workdir
        self.servers: list[Proc] = []
        for letter in "ab":
            d = workdir / f"redis-{letter}"
            d.mkdir(parents=True, exist_ok=True)
            p = redis_proc(d)
            p.name = f"redis-{letter}"
            self.servers.append(p)
        self.argv = [list(p.argv) for p in self.servers]  # as a primary; a replica adds --replicaof
        self.primary = 0
        self.sentinels = [self._sentinel(i, free_port()) for i in range(sentinels)]

    def _port(self, i: int) -> int:
        return int(self.servers[i].url.rsplit(":", 1)[1].split("/")[0])

    def _sentinel(self, i: int, port: int) -> Proc:
        exe = shutil.which("redis-sentinel")
        if exe is None:
            raise RuntimeError("redis-sentinel is not installed (Debian: apt-get install redis-sentinel)")  # fmt: skip
        return Proc(f"sentinel-{i}", [exe, str(self.workdir / f"sentinel-{i}.conf")],
                    f"redis://127.0.0.1:{port}")  # fmt: skip

    def _write_sentinel_conf(self, i: int) -> None:
        port = self.sentinels[i].url.rsplit(":", 1)[1]
        quorum = len(self.sentinels) // 2 + 1
        (self.workdir / f"sentinel-{i}.conf").write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {SENTINEL_NAME} 127.0.0.1 {self._port(0)} {quorum}\n"
            f"sentinel down-after-milliseconds {SENTINEL_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SENTINEL_NAME} 5000\n"
            f"sentinel parallel-syncs {SENTINEL_NAME} 1\n"
        )

    def start(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers[0].start(log_dir=log_dir)
        wait_for("primary up", lambda: self._node(0).ping(), 10)
        self._start_replica(1, of=0)
        for i, s in enumerate(self.sentinels):
            self._write_sentinel_conf(i)
            s.start(log_dir=log_dir)
        for i in range(len(self.sentinels)):
            wait_for(f"sentinel-{i} sees the replica", lambda i=i: self._sees_replica(i))

    def _node(self, i: int) -> redis.Redis:
        return redis.Redis(port=self._port(i), decode_responses=True, socket_timeout=2)

    def _sentinel_client(self, i: int) -> redis.Redis:
        port = int(self.sentinels[i].url.rsplit(":", 1)[1])
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2)

    def _sees_replica(self, i: int) -> bool:
        replicas = self._sentinel_client(i).sentinel_slaves(SENTINEL_NAME)
        want = self._port(1 - self.primary)
        return any(int(r["port"]) == want and "s_down" not in r["flags"] for r in replicas)

    def _start_replica(self, i: int, of: int) -> None:
        p = self.servers[i]
        p.argv = [*self.argv[i], "--replicaof", "127.0.0.1", str(self._port(of))]
        p.popen = None
        p.start(log_dir=self.log_dir)
        wait_for(f"{p.name} in sync", lambda: self._node(i).info("replication").get("master_link_status") == "up")  # fmt: skip

    def master_port(self) -> int:
        for i in range(len(self.sentinels)):
            try:
                got: Any = self._sentinel_client(i).sentinel_get_master_addr_by_name(SENTINEL_NAME)
                return int(got[1])
            except (redis.RedisError, TypeError, ValueError, IndexError):
                continue
        return -1

    def store_config(self) -> dict[str, Any]:
        nodes = [s.url.removeprefix("redis://") for s in self.sentinels]
        return {"sentinel": {"master": SENTINEL_NAME, "nodes": nodes}}

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.master_port(), decode_responses=True, socket_timeout=2)

    def inject(self) -> str:
        """The primary SIGKILLed; once promoted, the old primary back as the new one's replica."""
        old, new = self.primary, 1 - self.primary
        if self.master_port() != self._port(old):
            raise RuntimeError("the sentinels name another primary than the soak's")
        t0 = time.monotonic()
        kill(self.servers[old])
        promoted = wait_for("promotion", lambda: self.master_port() == self._port(new))
        self.primary = new
        self._start_replica(old, of=new)
        wait_for("sentinels see the new replica", lambda: self._sees_replica(0), 30)
        return (
            f"replica promoted {promoted:.1f} s after the kill; old primary in sync as its "
            f"replica {time.monotonic() - t0:.1f} s after"
        )

    def stop(self) -> None:
        for p in [*self.sentinels, *self.servers]:
            p.stop()


def soak_redis(kind: str, workdir: Path) -> SoakRedis:
    return SentinelRedis(workdir) if kind == "sentinel" else SingleRedis(workdir)
