"""Fault soak: a multi-replica fleet under the problem's workload while things fail on a schedule.

``python -m loadtest.bench soak --faults [--duration-s 1800]``. Real processes: one
``redis-server``, four simulated engines (two contiguous, two vLLM-like), two ``kvroute
serve`` replicas on the shared Redis. The problem's mix (70% chats, 30% documents of
15k-30k tokens, Poisson arrivals, every request streamed so its time to first token is
seen) is sent open-loop, alternately through each replica; a request refused by a dead
replica is resent to the other, as a load balancer would. Every ``--fault-every-s`` one
fault, in turn: a replica SIGKILLed and restarted 3 s later, Redis SIGKILLed and restarted
empty, an engine SIGKILLed and restarted 5 s later, a config reload (SIGHUP) of both
replicas, a storm of 20 clients that leave mid-stream.

Per window (``--window-s``): requests answered; failures by cause (``killed_replica``: cut
off with the replica that was serving them, which no gateway can save; the rest by code);
TTFT p50/p99 outside the 30 s after a fault; the largest excess of reserved tokens (the
survivor's ``/fleet``) over the demand really in flight (the client's count); each
replica's RSS, open files and TCP connections. After the load, how long until nothing is
reserved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.bench.proc_stats import proc_rss_mib, proc_sockets, proc_tcp
from loadtest.local_fleet import EngineSpec, Proc, engine_proc, free_port, redis_proc, wait_http
from loadtest.workload import bimodal, chat_overhead_tokens, make_prompt

FAULTS = ("replica", "redis", "engine", "reload", "disconnects")
AFTER_FAULT_S = 30.0


@dataclass
class Window:
    answered: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds)
    excess_reserved: int = 0
    excess_when: str = ""  # how long after which fault the largest excess was seen
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)


class FaultFleet:
    """Redis, engines and two replicas; each can be killed and started again on its port."""

    def __init__(self, workdir: Path, speedup: float) -> None:
        self.workdir = workdir
        self.redis = redis_proc(workdir)
        self.specs = [
            EngineSpec(f"c{i}", capacity_tokens=100_000, speedup=speedup) for i in range(2)
        ] + [
            EngineSpec(f"v{i}", capacity_tokens=100_000, speedup=speedup, extra=("--behaviour", "vllm"))
            for i in range(2)
        ]  # fmt: skip
        self.engines = [engine_proc(s) for s in self.specs]
        self.replicas: list[Proc] = []

    def start(self) -> None:
        self.redis.start(log_dir=self.workdir)
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
            "store": {"redis_url": self.redis.url, "leases": True},
            "collector": {"scrape_interval_s": 0.25, "stale_after_s": 3.0},
        }
        path = self.workdir / "kvroute.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        for i in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)]
            argv += ["--port", str(port), "--log-level", "warning", "--reload-on-hup"]
            self.replicas.append(Proc(f"replica-{i}", argv, f"http://127.0.0.1:{port}"))
        for r in self.replicas:
            self.restart(r)

    def restart(self, p: Proc, ready: str = "/health") -> None:
        p.popen = None
        p.start(log_dir=self.workdir)
        if p is not self.redis:
            wait_http(p.url + ready, timeout_s=60, proc=p.popen)

    def kill(self, p: Proc) -> None:
        p.signal(signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait(10)

    def stop(self) -> None:
        for p in [*self.replicas, *self.engines, self.redis]:
            p.stop()


@dataclass
class Client:
    """The load: open-loop, alternating replicas, a balancer's resend on a refused connection."""

    fleet: FaultFleet
    inflight_demand: int = 0
    # The most in flight since the monitor's last sample: a request that just ended may
    # still be in the /fleet it reads (its release is a round trip behind the last byte).
    peak_demand: int = 0
    turn: int = 0
    prompts: dict[int, str] = field(default_factory=dict)
    killed_at: dict[str, float] = field(default_factory=dict)
    back_at: dict[str, float] = field(default_factory=dict)

    def cut_off_by_kill(self, name: str, start: float) -> bool:
        """A request to replica ``name`` broke because that replica was killed: it was in
        flight at the kill, or sent (on a pooled connection) while the replica was down."""
        killed = self.killed_at.get(name, -1.0)
        back = self.back_at.get(name, -1.0)
        down = back < killed
        return killed >= start or down or time.monotonic() - back < 1.0

    def prompt(self, tokens: int) -> str:
        bucket = max(1, tokens // 250 * 250)
        if bucket not in self.prompts:
            self.prompts[bucket] = make_prompt(bucket, random.Random(bucket))
        return self.prompts[bucket]

    async def one(self, c: httpx.AsyncClient, prompt: int, output: int, w: Window) -> None:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": self.prompt(max(1, prompt - chat_overhead_tokens()))}],
            "max_tokens": output,
            "stream": True,
        }  # fmt: skip
        self.turn += 1
        order = [self.fleet.replicas[self.turn % 2], self.fleet.replicas[(self.turn + 1) % 2]]
        self.inflight_demand += prompt + output
        self.peak_demand = max(self.peak_demand, self.inflight_demand)
        try:
            for target in order:
                start = time.monotonic()
                try:
                    outcome = await self._stream(c, target.url, body, start, w)
                    if outcome:
                        w.failures[outcome] += 1
                    return
                except httpx.ConnectError:
                    continue  # refused: a dead replica; the balancer resends
                except httpx.HTTPError:
                    killed = self.cut_off_by_kill(target.name, start)
                    w.failures["killed_replica" if killed else "lost"] += 1
                    return
            w.failures["no_replica"] += 1
        finally:
            self.inflight_demand -= prompt + output

    async def _stream(
        self, c: httpx.AsyncClient, url: str, body: dict[str, Any], start: float, w: Window
    ) -> str:
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                code = (json.loads(raw or b"{}").get("error") or {}).get("code", "")
                return f"http_{resp.status_code}_{code}"
            first = True
            async for chunk in resp.aiter_bytes():
                if first and chunk:
                    w.ttft.append((start, time.monotonic() - start))
                    first = False
            w.answered += 1
            return ""


def reserved_tokens(fleet: FaultFleet) -> int | None:
    """Every backend's reserved tokens in the first live replica's ``/fleet``."""
    for r in fleet.replicas:
        if r.alive:
            try:
                got = httpx.get(r.url + "/fleet", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                continue
            return sum(int(b["overlay"]["reserved_tokens"]) for b in got["backends"])
    return None


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


async def inject(
    fleet: FaultFleet, client: Client, kind: str, n: int, c: httpx.AsyncClient
) -> None:
    """One fault; blocking process calls run in a thread, the load goes on."""
    if kind == "replica":
        r = fleet.replicas[n % 2]
        client.killed_at[r.name] = time.monotonic()
        await asyncio.to_thread(fleet.kill, r)
        await asyncio.sleep(3.0)
        await asyncio.to_thread(fleet.restart, r)
        client.back_at[r.name] = time.monotonic()
    elif kind == "redis":
        await asyncio.to_thread(fleet.kill, fleet.redis)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(fleet.restart, fleet.redis)
    elif kind == "engine":
        e = fleet.engines[n % len(fleet.engines)]
        await asyncio.to_thread(fleet.kill, e)
        await asyncio.sleep(5.0)
        await asyncio.to_thread(fleet.restart, e)
    elif kind == "reload":
        for r in fleet.replicas:
            r.signal(signal.SIGHUP)
    else:
        await disconnect_storm(fleet, client, c)


async def disconnect_storm(
    fleet: FaultFleet, client: Client, c: httpx.AsyncClient, n: int = 20
) -> None:
    """``n`` streams that leave after 0.5 s; their demand counts as in flight meanwhile."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi " * 200}],
            "max_tokens": 2000, "stream": True}  # fmt: skip
    demand = 200 + chat_overhead_tokens() + 2000

    async def leave(url: str) -> None:
        client.inflight_demand += demand
        client.peak_demand = max(client.peak_demand, client.inflight_demand)
        try:
            async with asyncio.timeout(0.5):
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass
        finally:
            client.inflight_demand -= demand

    await asyncio.gather(*(leave(fleet.replicas[i % 2].url) for i in range(n)))


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
        "replicas": w.replicas,
    }


async def run(args: argparse.Namespace, fleet: FaultFleet) -> dict[str, Any]:
    client = Client(fleet)
    windows: list[Window] = [Window()]
    fault_times: list[float] = []
    fault_log: list[tuple[float, str]] = []
    kinds = [k for k in FAULTS if k in args.only.split(",")] or list(FAULTS)
    start = time.monotonic()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as c:

        async def faults() -> None:
            n = 0
            while True:
                await asyncio.sleep(args.fault_every_s)
                kind = kinds[n % len(kinds)]
                fault_times.append(time.monotonic())
                fault_log.append((time.monotonic(), kind))
                windows[-1].faults.append(f"{round(time.monotonic() - start)}s {kind}")
                await inject(fleet, client, kind, n // len(kinds), c)
                n += 1

        async def monitor() -> None:
            while True:
                await asyncio.sleep(2.0)
                w = windows[-1]
                reserved = await asyncio.to_thread(reserved_tokens, fleet)
                demand, client.peak_demand = client.peak_demand, client.inflight_demand
                if reserved is not None and reserved - demand > w.excess_reserved:
                    w.excess_reserved = reserved - demand
                    w.excess_when = since_fault(start, fault_log)
                w.replicas = await asyncio.to_thread(replica_resources, fleet)
                if time.monotonic() - start >= len(windows) * args.window_s:
                    print(json.dumps(window_json(w, fault_times)), flush=True)
                    windows.append(Window())

        background = [asyncio.create_task(faults()), asyncio.create_task(monitor())]
        tasks: set[asyncio.Task[None]] = set()
        for req in bimodal(args.rate, duration_s=args.duration_s, seed=args.seed):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(
                client.one(c, req.prompt_tokens, req.output_tokens, windows[-1])
            )
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        background[0].cancel()
        await asyncio.gather(*tasks)
        background[1].cancel()
    ended = time.monotonic()
    for _ in range(300):  # at most 60 s
        if not await asyncio.to_thread(reserved_tokens, fleet):
            break
        await asyncio.sleep(0.2)
    return {
        "windows": [window_json(w, fault_times) for w in windows if w.answered or w.failures],
        "reserved_zero_after_load_s": round(time.monotonic() - ended, 2),
        "reserved_after_load": reserved_tokens(fleet),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute soak --faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", action="store_true", help="(the subcommand's switch)")
    p.add_argument(
        "--duration-s", type=float, default=1800.0, help="load duration (default 30 min)"
    )
    p.add_argument("--window-s", type=float, default=300.0, help="report window (default 5 min)")
    p.add_argument("--fault-every-s", type=float, default=60.0, help="one fault every this long")
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--speedup", type=float, default=50.0, help="engine simulated-time speedup")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only", default="", help="these faults only, comma-separated: " + ",".join(FAULTS)
    )
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = p.parse_args(argv)
    fleet = FaultFleet(Path(tempfile.mkdtemp(prefix="kvroute-soak-faults-")), args.speedup)
    try:
        fleet.start()
        summary = asyncio.run(run(args, fleet))
    finally:
        fleet.stop()
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
