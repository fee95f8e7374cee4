"""Fault soak: a multi-replica fleet under the problem's workload while things fail on a schedule.

``python -m loadtest.bench soak --faults [--duration-s 1800] [--replicas 3] [--redis
sentinel|single]``. Real processes: Redis (``sentinel``, the default: a primary, its replica
and three sentinels; ``single``: one ``redis-server``), four simulated engines (two
contiguous, two vLLM-like), ``--replicas`` ``kvroute serve`` replicas sharing it, replica
leases on (the default). The problem's mix (70% chats, 30% documents of 15k-30k tokens,
Poisson arrivals, every request streamed so its time to first token is seen) is sent
open-loop through the replicas in turn; a request refused by a dead replica is resent to the
next, as a load balancer would. Every ``--fault-every-s`` one fault, in turn: a replica
SIGKILLed and restarted 3 s later; Redis: with Sentinel the primary SIGKILLed and failed
over (``failover``, loadtest/bench/soak_redis.py), else SIGKILLed and restarted empty
(``redis``); an engine SIGKILLed and restarted 5 s later; a config reload (SIGHUP) of every
replica; a storm of 20 clients that leave mid-stream.

Per window (``--window-s``): requests answered; failures by cause (``killed_replica``: cut
off with the replica that was serving them, which no gateway can save; the rest by code);
TTFT p50/p99 outside the 30 s after a fault; the largest excess of reserved tokens (a live
replica's ``/fleet``) over the demand really in flight (the client's count); each replica's
RSS, open files and TCP connections. Every ``--quiet-every-s``, right after each replica
kill (made while that replica holds reservations of its own) and after the load, a quiet
moment: no new requests until those in flight end, then how
long until every live replica's ``/fleet`` and Redis show nothing reserved
(loadtest/bench/soak_quiet.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.bench.proc_stats import proc_rss_mib, proc_sockets, proc_tcp
from loadtest.bench.soak_client import Client, Window, disconnect_storm
from loadtest.bench.soak_quiet import QUIET_WATCH_S, quiet_moment, reserved_tokens, wait_holding
from loadtest.bench.soak_redis import kill, soak_redis
from loadtest.local_fleet import EngineSpec, Proc, engine_proc, free_port, wait_http
from loadtest.workload import bimodal

FAULTS = ("replica", "redis", "engine", "reload", "disconnects")
AFTER_FAULT_S = 30.0
LEASE_TTL_S = 5.0  # store.lease_ttl_s's default, written into the replicas' config

__all__ = ["FAULTS", "Window", "fault_cycle", "percentile", "window_json"]


def fault_cycle(redis_fault: str, only: str = "") -> list[str]:
    """The faults in turn; the Redis one named for the topology (``redis`` or ``failover``)."""
    kinds = [redis_fault if k == "redis" else k for k in FAULTS]
    chosen = [k for k in kinds if k in only.split(",")]
    return chosen or kinds


class FaultFleet:
    """Redis, engines and the replicas; each can be killed and started again on its port."""

    def __init__(self, workdir: Path, speedup: float, replicas: int = 3, redis: str = "sentinel") -> None:  # fmt: skip
        self.workdir = workdir
        self.redis = soak_redis(redis, workdir)
        self.specs = [
            EngineSpec(f"c{i}", capacity_tokens=100_000, speedup=speedup) for i in range(2)
        ] + [
            EngineSpec(f"v{i}", capacity_tokens=100_000, speedup=speedup, extra=("--behaviour", "vllm"))
            for i in range(2)
        ]  # fmt: skip
        self.engines = [engine_proc(s) for s in self.specs]
        self.n_replicas = replicas
        self.replicas: list[Proc] = []

    @property
    def backends(self) -> list[str]:
        return [s.name for s in self.specs]

    def start(self) -> None:
        self.redis.start(self.workdir)
        for e in self.engines:
            e.start(log_dir=self.workdir)
        for e in self.engines:
            wait_http(e.url + "/health", timeout_s=30, proc=e.popen)
        backends = [
            {"name": s.name, "url": e.url, "kind": "vllm" if s.name.startswith("v") else "contiguous"}
            for s, e in zip(self.specs, self.engines, strict=True)
        ]  # fmt: skip
        cfg = {
            "backends": backends,
            "store": {**self.redis.store_config(), "leases": True, "lease_ttl_s": LEASE_TTL_S},
            "collector": {"scrape_interval_s": 0.25, "stale_after_s": 3.0},
        }
        path = self.workdir / "kvroute.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        for i in range(self.n_replicas):
            port = free_port()
            argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)]
            argv += ["--port", str(port), "--log-level", "warning", "--reload-on-hup"]
            self.replicas.append(Proc(f"replica-{i}", argv, f"http://127.0.0.1:{port}"))
        for r in self.replicas:
            self.restart(r)

    def restart(self, p: Proc, ready: str = "/health") -> None:
        p.popen = None
        p.start(log_dir=self.workdir)
        wait_http(p.url + ready, timeout_s=60, proc=p.popen)

    def stop(self) -> None:
        for p in [*self.replicas, *self.engines]:
            p.stop()
        self.redis.stop()


def replica_resources(fleet: FaultFleet) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in fleet.replicas:
        if r.alive and r.popen is not None:
            try:
                fds, inodes = proc_sockets(r.popen.pid)
                tcp = proc_tcp(r.popen.pid, inodes)
                rss = proc_rss_mib(r.popen.pid)
            except OSError:
                continue
            out[r.name] = {"rss_mib": round(rss, 1), "fds": fds, "tcp": sum(tcp.values())}
    return out


async def inject(fleet: FaultFleet, client: Client, kind: str, n: int, c: httpx.AsyncClient) -> str:
    """One fault; blocking process calls run in a thread, the load goes on. What happened."""
    if kind in ("redis", "failover"):
        return await asyncio.to_thread(fleet.redis.inject)
    if kind == "engine":
        e = fleet.engines[n % len(fleet.engines)]
        await asyncio.to_thread(kill, e)
        await asyncio.sleep(5.0)
        await asyncio.to_thread(fleet.restart, e)
        return e.name
    if kind == "reload":
        for r in fleet.replicas:
            r.signal(signal.SIGHUP)
        return "SIGHUP to every replica"
    await disconnect_storm(client, c)
    return "20 streams left after 0.5 s"


def since_fault(start: float, fault_log: Sequence[tuple[float, str]]) -> str:
    now = time.monotonic()
    if not fault_log:
        return f"{now - start:.0f} s into the run, before any fault"
    at, kind = fault_log[-1]
    return f"{now - at:.1f} s after the {kind} fault"


def percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return round(ys[min(len(ys) - 1, int(q * len(ys)))], 3)


def window_json(w: Window, fault_times: Sequence[float]) -> dict[str, Any]:
    calm = [t for at, t in w.ttft if not any(0 <= at - f <= AFTER_FAULT_S for f in fault_times)]
    return {
        "answered": w.answered,
        "failures": dict(w.failures),
        "faults": w.faults,
        "ttft_p50_s": percentile(calm, 0.5),
        "ttft_p99_s": percentile(calm, 0.99),
        "ttft_samples_outside_faults": len(calm),
        "max_reserved_over_inflight_tokens": w.excess_reserved,
        "max_reserved_over_inflight_when": w.excess_when,
        "max_reserved_over_inflight_detail": w.excess_detail,
        "quiet_moments": w.quiet,
        "replicas": w.replicas,
    }


class Soak:
    """One run: the load, the faults and the monitor on one loop; quiet moments hold faults off."""

    def __init__(self, args: argparse.Namespace, fleet: FaultFleet) -> None:
        self.args, self.fleet = args, fleet
        self.client = Client(fleet.replicas)
        self.windows: list[Window] = [Window()]
        self.fault_log: list[tuple[float, str]] = []
        self.fault_notes: list[dict[str, Any]] = []
        self.kinds = fault_cycle(fleet.redis.fault, args.only)
        self.hold = asyncio.Lock()  # a fault or a quiet moment, never both
        self.tasks: set[asyncio.Task[None]] = set()
        self.resume = asyncio.Event()  # cleared: the load waits (a quiet moment after a kill)
        self.resume.set()
        self.start = time.monotonic()

    def at(self) -> float:
        return round(time.monotonic() - self.start, 1)

    async def faults(self, c: httpx.AsyncClient) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.args.fault_every_s)
            kind = self.kinds[n % len(self.kinds)]
            async with self.hold:
                self.fault_log.append((time.monotonic(), kind))
                self.windows[-1].faults.append(f"{round(self.at())}s {kind}")
                at = self.at()
                try:
                    if kind == "replica":
                        note = await self.kill_replica(n // len(self.kinds))
                    else:
                        note = await inject(self.fleet, self.client, kind, n // len(self.kinds), c)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    note = f"FAILED: {exc}"
                self.fault_notes.append({"at_s": at, "kind": kind, "note": note})
                print(json.dumps({"fault": kind, "at_s": at, "note": note}), flush=True)
            n += 1

    async def monitor(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            w = self.windows[-1]
            reserved, holders = await asyncio.to_thread(reserved_tokens, self.fleet.replicas)
            demand, self.client.peak_demand = self.client.peak_demand, self.client.inflight_demand
            if reserved is not None and reserved - demand > w.excess_reserved:
                w.excess_reserved = reserved - demand
                w.excess_when = since_fault(self.start, self.fault_log)
                w.excess_detail = {"reserved": reserved, "in_flight": demand, **holders}
            w.replicas = await asyncio.to_thread(replica_resources, self.fleet)
            if time.monotonic() - self.start >= len(self.windows) * self.args.window_s:
                print(json.dumps(window_json(w, [f for f, _ in self.fault_log])), flush=True)
                self.windows.append(Window())

    async def kill_replica(self, n: int) -> str:
        """SIGKILL a replica while it holds reservations; the load pauses for a quiet moment
        (its reservations must stop counting within the lease TTL); restart 3 s after the kill."""
        r = self.fleet.replicas[n % len(self.fleet.replicas)]
        held = await asyncio.to_thread(wait_holding, r.url)
        self.resume.clear()
        killed = self.client.killed_at[r.name] = time.monotonic()
        await asyncio.to_thread(kill, r)
        try:
            q = await self.measure_quiet()
            q["zero_after_kill_s"] = round(q["drain_s"] + (q["zero_after_s"] or QUIET_WATCH_S), 2)
        finally:
            self.resume.set()
        await asyncio.sleep(max(0.0, killed + 3.0 - time.monotonic()))
        await asyncio.to_thread(self.fleet.restart, r)
        self.client.back_at[r.name] = time.monotonic()
        return f"{r.name}, holding {held} tokens of its own; reserved 0 {q['zero_after_kill_s']} s after"

    async def measure_quiet(self) -> dict[str, Any]:
        at, after = self.at(), since_fault(self.start, self.fault_log)
        q = await quiet_moment(self.fleet.replicas, self.fleet.redis, self.fleet.backends,
                               self.tasks, LEASE_TTL_S)  # fmt: skip
        q = {"at_s": at, "after": after, **q}
        self.windows[-1].quiet.append(q)
        print(json.dumps({"quiet": q}), flush=True)
        return q

    async def quiet(self) -> dict[str, Any]:
        async with self.hold:
            return await self.measure_quiet()

    async def load(self, c: httpx.AsyncClient) -> None:
        """The arrivals, open-loop; a quiet moment shifts the rest of the schedule by its length."""
        shift, next_quiet = 0.0, self.args.quiet_every_s
        for req in bimodal(self.args.rate, duration_s=self.args.duration_s, seed=self.args.seed):
            if req.arrival_s >= next_quiet:
                paused = time.monotonic()
                await self.quiet()
                shift += time.monotonic() - paused
                while next_quiet <= req.arrival_s:
                    next_quiet += self.args.quiet_every_s
            delay = self.start + shift + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.resume.is_set():
                paused = time.monotonic()
                await self.resume.wait()
                shift += time.monotonic() - paused
            w = self.windows[-1]
            t = asyncio.create_task(self.client.one(c, req.prompt_tokens, req.output_tokens, w))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def run(self) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as c:
            background = [asyncio.create_task(self.faults(c)), asyncio.create_task(self.monitor())]
            await self.load(c)
            async with self.hold:  # a fault under way ends first
                background[0].cancel()
            final = await self.quiet()
            background[1].cancel()
        fault_times = [f for f, _ in self.fault_log]
        windows = [w for w in self.windows if w.answered or w.failures or w.quiet]
        return {
            "redis": self.fleet.redis.kind,
            "replicas": len(self.fleet.replicas),
            "load_s": self.at(),
            "windows": [window_json(w, fault_times) for w in windows],
            "faults": self.fault_notes,
            "after_load": final,
        }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute soak --faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", action="store_true", help="(the subcommand's switch)")
    p.add_argument(
        "--duration-s", type=float, default=1800.0, help="load duration (default 30 min)"
    )
    p.add_argument("--window-s", type=float, default=300.0, help="report window (default 5 min)")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="one fault every this long")
    p.add_argument("--quiet-every-s", type=float, default=300.0,
                   help="a quiet moment (load paused until reserved reads 0) every this long of load")  # fmt: skip
    p.add_argument("--replicas", type=int, default=3, help="gateway replicas (default 3)")
    p.add_argument("--redis", choices=("sentinel", "single"), default="sentinel",
                   help="Sentinel (primary, replica, 3 sentinels; fault: failover) or one server")  # fmt: skip
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--speedup", type=float, default=50.0, help="engine simulated-time speedup")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only", default="", help="these faults only, comma-separated: " + ",".join(FAULTS) + ",failover"
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-soak-faults-"))
    fleet = FaultFleet(workdir, args.speedup, args.replicas, args.redis)
    try:
        fleet.start()
        summary = asyncio.run(Soak(args, fleet).run())
    finally:
        fleet.stop()
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
