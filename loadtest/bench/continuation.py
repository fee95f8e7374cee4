"""One engine of four killed mid-run under streaming load: how many streams still complete?

Four vLLM-mode engines (``kvroute engine --behaviour vllm``), the bimodal mix scaled down
(70% short chats, 30% long documents), every client streaming (chat), sent open-loop. At
``--kill-at`` seconds engine ``e1`` is SIGKILLed (every stream it was answering breaks
mid-body); ``--down`` seconds later it starts again on the same port. The same request list
(same seed, same arrival times) goes through each system in turn, on fresh engines:

* ``kvroute``: continuation on (the default for vLLM backends; docs/continuation.md);
* ``kvroute-no-continuation``: ``continuation.enabled: false``, what kvroute did before
  (a stream broken after its first byte ends with an SSE error event);
* ``vllm-router:round_robin``: when found on PATH or in /tmp/vllm-router-venv
  (``loadtest.bench.overhead_targets.find_vllm_router``); skipped otherwise.

A stream is *complete* when it ended with a finish reason and ``[DONE]`` and no error event.
For kvroute's continued streams (``metadata.kvroute_continuations`` on the final chunk) the
added time to finish is measured by the client as the pause at the splice: the longest gap
between two content events of that stream, less the median gap of all streams of the run.

    python -m loadtest.bench.continuation --quick --json out/continuation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.engine_fleet import start_gateway
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.children import stop_processes
from loadtest.local_fleet import free_port
from loadtest.workload import Request, bimodal, chat_overhead_tokens, make_prompt

ENGINES = ("e0", "e1", "e2", "e3")
KILLED = "e1"
MODEL = "sim-model"


@dataclass
class Outcome:
    kind: str
    complete: bool
    continued: bool = False
    backend: str = ""
    # Why it did not complete: "http:<status>:<code>", "stream:<code>", "cut" (no [DONE]).
    failure: str = ""
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


@dataclass
class SystemRun:
    system: str
    outcomes: list[Outcome]
    wall_s: float
    # What the gateway counted: breaks by cause and action, continuations, budget refusals.
    gateway: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        n = len(self.outcomes)
        done = sum(o.complete for o in self.outcomes)
        continued = [o for o in self.outcomes if o.continued]
        every_gap = [g for o in self.outcomes for g in o.gaps]
        typical = statistics.median(every_gap) if every_gap else 0.0
        added = sorted(max(o.gaps, default=typical) - typical for o in continued)
        return {
            "system": self.system,
            "streams": n,
            "completed": done,
            "completed_pct": 100.0 * done / n if n else 0.0,
            "continued": len(continued),
            "continued_completed": sum(o.complete for o in continued),
            "added_p50_s": _pct(added, 0.5),
            "added_p99_s": _pct(added, 0.99),
            "typical_gap_s": typical,
            "wall_s": self.wall_s,
            "failures": dict(Counter(o.failure for o in self.outcomes if not o.complete)),
            "gateway": self.gateway,
        }


def gateway_counters(url: str) -> dict[str, float]:
    """The gateway's own count of breaks, continuations and retry-budget refusals."""
    text = httpx.get(url + "/metrics", timeout=5).text
    wanted = (
        "kvroute_stream_breaks_total",
        "kvroute_continuations_total",
        "kvroute_retry_budget_exhausted_total",
    )
    return {
        s.name + json.dumps(s.labels, sort_keys=True): float(s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in wanted
    }


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def start_engine(name: str, port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    """One vLLM-mode engine on ``port`` (fixed, so it comes back at the same URL)."""
    argv = [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", "vllm"]
    argv += ["--port", str(port), "--name", name, "--model", MODEL]
    argv += ["--capacity-tokens", str(args.capacity), "--block-size", "16"]
    argv += ["--decode-tokens-per-s", "30", "--speedup", str(args.speedup)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"engine {name} did not start: {line!r}")
    return proc


def start_vllm_router(
    exe: str, policy: str, urls: list[str], workdir: Path
) -> tuple[subprocess.Popen[str], str]:
    """vllm-router in front of the engines, its metrics on a free port of its own (its default,
    29000, may be taken by another run on the box); ready once a request gets a 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    port = free_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    argv += ["--worker-urls", *urls]
    log_path = workdir / "vllm-router.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
            if r.status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_processes([proc])
    raise RuntimeError(f"vllm-router did not serve: {log_path.read_text()[-400:]!r}")


def gateway_config(urls: dict[str, str], continuation: bool) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "backends": [{"name": n, "url": u, "kind": "vllm"} for n, u in urls.items()],
        "pools": {"general": {"role": "general"}},
        "collector": {"scrape_interval_s": 0.25, "stale_after_s": 5.0},
        "health": {"active": {"enabled": False}},
        "continuation": {"enabled": continuation},
    }


async def one(client: httpx.AsyncClient, url: str, req: Request, body: dict[str, Any]) -> Outcome:
    out = Outcome(req.kind, complete=False)
    finished = done = failed = False
    last: float | None = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            out.backend = resp.headers.get("x-kvroute-backend", "")
            if resp.status_code != 200:
                err = json.loads(await resp.aread()).get("error") or {}
                out.failure = f"http:{resp.status_code}:{err.get('code')}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    failed = True
                    out.failure = f"stream:{(obj['error'] or {}).get('code')}"
                    continue
                meta = obj.get("metadata") or {}
                out.continued = out.continued or "kvroute_continuations" in meta
                for choice in obj.get("choices") or []:
                    finished = finished or choice.get("finish_reason") is not None
                    if (choice.get("delta") or {}).get("content"):
                        now = time.monotonic()
                        if last is not None:
                            out.gaps.append(now - last)
                        last = now
                        out.tokens += 1
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError) as exc:
        out.failure = out.failure or type(exc).__name__
        return out
    out.complete = finished and done and not failed
    if not out.complete and not out.failure:
        out.failure = "cut"
    return out


def bodies(requests: list[Request], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    overhead = chat_overhead_tokens()
    return [
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": make_prompt(max(1, r.prompt_tokens - overhead), rng)}
            ],
            "max_tokens": max(1, r.output_tokens),
            "stream": True,
        }
        for r in requests
    ]


async def drive(
    url: str, requests: list[Request], args: argparse.Namespace, fleet: Fleet
) -> list[Outcome]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.monotonic()
        chaos = asyncio.create_task(fleet.kill_and_revive(start, args))
        tasks: list[asyncio.Task[Outcome]] = []
        for req, body in zip(requests, bodies(requests, args.seed), strict=True):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, req, body)))
        outcomes = list(await asyncio.gather(*tasks))
        await chaos
        return outcomes


@dataclass
class Fleet:
    """The four engines; one is killed and brought back on the same port."""

    args: argparse.Namespace
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def start(self) -> dict[str, str]:
        for name in ENGINES:
            self.ports[name] = free_port()
            self.procs[name] = start_engine(name, self.ports[name], self.args)
        return {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}

    async def kill_and_revive(self, start: float, args: argparse.Namespace) -> None:
        await asyncio.sleep(max(0.0, start + args.kill_at - time.monotonic()))
        self.procs[KILLED].send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.procs[KILLED].wait)
        await asyncio.sleep(args.down)
        self.procs[KILLED] = await asyncio.to_thread(
            start_engine, KILLED, self.ports[KILLED], self.args
        )

    def stop(self) -> None:
        stop_processes(self.procs.values())


def run_system(system: str, requests: list[Request], args: argparse.Namespace) -> SystemRun:
    fleet = Fleet(args)
    router: subprocess.Popen[str] | None = None
    try:
        urls = fleet.start()
        with tempfile.TemporaryDirectory() as tmp:
            if system.startswith("vllm-router:"):
                exe, policy = args.vllm_router_exe, system.partition(":")[2]
                router, url = start_vllm_router(exe, policy, list(urls.values()), Path(tmp))
            else:
                cfg = gateway_config(urls, continuation=system == "kvroute")
                if args.budget_percent is not None:
                    cfg["retry"] = {"budget_percent": args.budget_percent}
                router, url = start_gateway(cfg, Path(tmp))
            started = time.monotonic()
            outcomes = asyncio.run(drive(url, requests, args, fleet))
            run = SystemRun(system, outcomes, time.monotonic() - started)
            if not system.startswith("vllm-router:"):
                run.gateway = gateway_counters(url)
            return run
    finally:
        if router is not None:
            stop_processes([router])
        fleet.stop()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| system | streams completed | broken streams continued | added time to finish, "
        "continued streams p50 / p99 (s) |\n|---|---|---|---|"
    )
    lines = [
        f"| {r['system']} | {r['completed']}/{r['streams']} ({r['completed_pct']:.1f}%) "
        f"| {r['continued_completed']}/{r['continued']} "
        f"| {fmt(r['added_p50_s'])} / {fmt(r['added_p99_s'])} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.continuation", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a short run (12 s of arrivals)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    p.add_argument("--kill-at", type=float, default=None, help="seconds in (default 40%%)")
    p.add_argument("--down", type=float, default=3.0, help="seconds the engine stays dead")
    p.add_argument("--speedup", type=float, default=1.0, help="engines' time acceleration")
    p.add_argument("--capacity", type=int, default=200_000, help="KV tokens per engine")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--vllm-router", default=None, help="vllm-router executable")
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated subset of kvroute, kvroute-no-continuation, vllm-router:round_robin",
    )
    p.add_argument(
        "--budget-percent",
        type=float,
        default=None,
        help="the gateways' retry.budget_percent (default: kvroute's own default)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 12.0
    if args.kill_at is None:
        args.kill_at = 0.4 * args.duration
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = bimodal(
        args.rate,
        duration_s=args.duration,
        seed=args.seed,
        short=(20, 400),
        long=(2_000, 6_000),
        short_output=(40, 160),
        long_output=(200, 500),
    )
    systems = ["kvroute", "kvroute-no-continuation"]
    if args.vllm_router_exe is not None:
        systems.append("vllm-router:round_robin")
    else:
        print("vllm-router not found: its row is skipped", file=sys.stderr)
    if args.systems:
        systems = [s for s in args.systems.split(",") if s in systems]
    rows = []
    for system in systems:
        try:
            rows.append(run_system(system, requests, args).summary())
        except RuntimeError as exc:
            print(f"{system}: skipped: {exc}", file=sys.stderr)
            continue
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": _plain(args), "rows": rows}, indent=2))
    return 0


def _plain(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


if __name__ == "__main__":
    sys.exit(main())
