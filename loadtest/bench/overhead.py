"""Gateway overhead: direct access vs kvroute vs vllm-router, on the same backends, in one run.

Starts trivial backends (``loadtest.engine.trivial``: every answer pre-built, so what is
measured on top of them is the router's cost), then, one after another, drives the same
tiny OpenAI chat request at each target and concurrency with the same load generator:

- ``direct``: the first backend itself, no router;
- ``kvroute``: ``kvroute serve`` as shipped (FastAPI on uvicorn, httptools, uvloop, aiohttp
  upstream client), embedded store; ``kvroute-redis``: the same on a local redis-server;
- ``vllm-router``: the Rust router from PyPI (``--policy round_robin``), where installed;
- ``bare-aiohttp-proxy``: a do-nothing round-robin relay (``loadtest.bench.bare_proxy``),
  the floor of any Python proxy on the same libraries;
- ``--client-ab``, ``--coalesce-ab``, ``--lean-ab``: the same gateway with one switch
  turned the other way (upstream.client aiohttp; head and body in two writes; inference
  requests through the ASGI stack), measured in the same run.

(The server-stack variants and the FastAPI-vs-Starlette layer cost that chose today's
settings are in docs/lab/README.md.)

For each it prints requests/s and the ratio to direct, p50/p99 latency and what the router
adds to them, the router's CPU time per request (the least noisy figure on a shared box),
and for ``stream: true`` the SSE relay rate in events/s. The load generator is wrk (Debian
package ``wrk``) with a Lua script when installed, else an in-process aiohttp generator;
``--calibrate`` measures both against direct so the choice is evidence, not habit.

    python -m loadtest.bench.overhead --duration 3 --concurrency 1,16,64 --json out/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.bench.overhead_decision import decision_and_lag
from loadtest.bench.overhead_extras import store_round_trips
from loadtest.bench.overhead_load import (
    CHAT_PATH,
    cpu_seconds,
    find_wrk,
    request_body,
    run_python_load,
    run_wrk,
)
from loadtest.bench.overhead_report import (
    Point,
    add_ratios,
    loadavg,
    merge_rounds,
    print_summary,
    print_table,
    summary,
)
from loadtest.bench.overhead_targets import Bench, Target, count_sse_events

# ------------------------------------------------------------------ measuring


def measure(bench: Bench, target: Target, mode: str, conc: int, gen: str, wrk: str | None) -> Point:
    body = request_body(mode == "sse")
    url = target.url + CHAT_PATH
    backend_pids = [p.popen.pid for p in bench.backends if p.popen is not None]
    router_pids = [] if target.name == "direct" else target.pids
    b0, r0 = cpu_seconds(backend_pids), cpu_seconds(router_pids)
    if gen == "wrk" and wrk is not None:
        load = run_wrk(
            wrk, url, body, conc, bench.args.duration, bench.workdir, bench.args.wrk_threads
        )
    else:
        load = asyncio.run(run_python_load(url, body, conc, bench.args.duration))
    b1, r1 = cpu_seconds(backend_pids), cpu_seconds(router_pids)
    n = max(1, load.requests)
    return Point(
        target=target.name,
        mode=mode,
        concurrency=conc,
        rps=load.rps,
        p50_ms=load.p50_ms,
        p99_ms=load.p99_ms,
        errors=load.errors,
        requests=load.requests,
        router_cpu_us_per_req=None if target.name == "direct" else (r1 - r0) / n * 1e6,
        backend_cpu_us_per_req=(b1 - b0) / n * 1e6,
    )


def calibrate(bench: Bench, wrk: str | None) -> dict[str, Any]:
    """Both generators against direct at the highest concurrency: the faster one is not the bottleneck."""
    conc = max(bench.args.concurrency)
    target = bench.direct()
    out: dict[str, Any] = {"concurrency": conc}
    for gen in (["wrk"] if wrk else []) + ["python"]:
        p = measure(bench, target, "json", conc, gen, wrk)
        out[gen] = {
            "rps": round(p.rps, 1),
            "p50_ms": round(p.p50_ms, 3),
            "backend_cpu_us_per_req": round(p.backend_cpu_us_per_req, 1),
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench overhead",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    add_point_options(p)
    add_target_options(p)
    add_run_options(p)
    return p


def add_point_options(p: argparse.ArgumentParser) -> None:
    """What one measured point is: its length, concurrencies, modes, rounds, backends."""
    p.add_argument(
        "--duration", type=float, default=3.0, help="seconds per measurement point (default 3)"
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16, 64],
        help="comma list (default 1,16,64)",
    )
    p.add_argument(
        "--modes",
        default="json,sse",
        help="json (non-streaming), sse (streaming), or both (default)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every point this often, interleaved; medians are reported",
    )
    p.add_argument(
        "--backends",
        type=int,
        default=1,
        help="trivial backends behind the routers (direct uses the first)",
    )
    p.add_argument(
        "--stream-chunks", type=int, default=64, help="SSE events per streamed answer (default 64)"
    )
    p.add_argument(
        "--policy",
        default="kvroute",
        help="kvroute routing policy for the gateway (default kvroute)",
    )


def add_target_options(p: argparse.ArgumentParser) -> None:
    """Which targets run beside direct and kvroute."""
    p.add_argument("--no-redis", action="store_true", help="skip the kvroute-redis target")
    p.add_argument(
        "--client-ab",
        action="store_true",
        help="add kvroute-aiohttp-client: the same gateway with upstream.client aiohttp",
    )
    p.add_argument(
        "--coalesce-ab",
        action="store_true",
        help="add kvroute-two-writes: the same gateway writing a response's head and body apart",
    )
    p.add_argument(
        "--lean-ab",
        action="store_true",
        help="add kvroute-asgi: the same gateway serving inference POSTs through the ASGI stack",
    )
    p.add_argument(
        "--no-vllm-router", action="store_true", help="skip vllm-router even if installed"
    )
    p.add_argument(
        "--vllm-router",
        default=None,
        help="path of the vllm-router executable (default: PATH, then /tmp/vllm-router-venv)",
    )
    p.add_argument(
        "--no-bare-proxy",
        action="store_true",
        help="skip the bare aiohttp round-robin proxy (the stand-in for vllm-router's floor)",
    )


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The load generator, the extra figures, the run's size and output."""
    p.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="auto: wrk when installed",
    )
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure wrk and the python generator against direct first",
    )
    p.add_argument(
        "--no-extras",
        action="store_true",
        help="skip store round trips, 1 vs 2 workers, and the 30k-token decision / loop lag",
    )
    p.add_argument(
        "--long-requests",
        type=int,
        default=15,
        help="30k-token requests timed alone; the 30%%-long mix sends about 7x as many (default 15)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="everything at small sizes in about a minute: 1 s points, c=1,32, 2 backends",
    )
    p.add_argument(
        "--json", dest="json_out", default=None, help="write all results as JSON to this file"
    )


def apply_quick(args: argparse.Namespace) -> None:
    """--quick: short points, the two concurrencies the targets name, two backends."""
    if args.quick:
        args.duration = 1.0
        args.concurrency = [1, 32]
        args.backends = 2
        args.rounds = 1
        args.long_requests = min(args.long_requests, 5)


def start_targets(bench: Bench, args: argparse.Namespace) -> tuple[list[Target], list[Target]]:
    """The targets every point measures, and the extra ones measured at the top concurrency."""
    targets = [bench.direct(), bench.kvroute("kvroute", redis=False)]
    if args.client_ab:
        targets.append(bench.kvroute("kvroute-aiohttp-client", redis=False, client="aiohttp"))
    if args.coalesce_ab:
        env = {"KVROUTE_COALESCE_WRITES": "0"}
        targets.append(bench.kvroute("kvroute-two-writes", redis=False, env=env))
    if args.lean_ab:
        targets.append(bench.kvroute("kvroute-asgi", redis=False, env={"KVROUTE_LEAN": "0"}))
    if not args.no_redis:
        if shutil.which("redis-server"):
            targets.append(bench.kvroute("kvroute-redis", redis=True))
        else:
            bench.skipped["kvroute-redis"] = "redis-server is not installed"
    if not args.no_vllm_router:
        vr = bench.vllm_router()
        if vr is not None:
            targets.append(vr)
    if not args.no_bare_proxy:
        targets.append(bench.bare_proxy())
    extra: list[Target] = []
    if not args.no_extras and "kvroute-redis" in {t.name for t in targets}:
        extra.append(bench.kvroute("kvroute-redis-w2", redis=True, workers=2))
    return targets, extra


def measure_all(
    bench: Bench, targets: list[Target], extra: list[Target], gen: str, wrk: str | None
) -> list[Point]:
    """Every point, ``--rounds`` times interleaved, merged; ratios to direct added."""
    args = bench.args
    modes = [m for m in args.modes.split(",") if m]
    events = {t.name: count_sse_events(t.url) for t in targets + extra} if "sse" in modes else {}
    raw: dict[tuple[str, str, int], list[Point]] = {}
    top = max(args.concurrency)
    for _ in range(args.rounds):
        for mode in modes:
            for conc in args.concurrency:
                for t in targets + extra if conc == top else targets:
                    point = measure(bench, t, mode, conc, gen, wrk)
                    raw.setdefault((t.name, mode, conc), []).append(point)
    points = [merge_rounds(v) for v in raw.values()]
    add_ratios(points, events)
    return points


def measure_extras(bench: Bench, targets: list[Target]) -> dict[str, Any]:
    """Store round trips (with Redis) and the 30k-token decision and loop lag."""
    args = bench.args
    extras: dict[str, Any] = {}
    by_name = {t.name: t for t in targets}
    if "kvroute-redis" in by_name and bench.redis is not None:
        extras["store_round_trips"] = store_round_trips(
            by_name["kvroute-redis"].url, bench.redis.url, n=120 if args.quick else 600
        )
    extras["decision"] = decision_and_lag(
        bench.gateway_config_path("decision", False),
        n_long=args.long_requests,
        mix_n=7 * args.long_requests,
    )
    return extras


def print_report(result: dict[str, Any], points: list[Point], skipped: dict[str, str]) -> None:
    """The run's header lines, table and summary on stdout."""
    machine, cal = result["machine"], result["calibration"]
    print(
        f"load generator: {result['loadgen']}; {machine['cpus']} CPUs; load average before "
        f"{machine['loadavg_before']}, after {machine['loadavg_after']}"
    )
    if cal:
        print(
            f"calibration against direct at c={cal['concurrency']}: "
            + "; ".join(f"{k}: {v}" for k, v in cal.items() if k != "concurrency")
        )
    print_table(points, skipped, result["notes"])
    print_summary(result["summary"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    wrk = find_wrk()
    gen = "wrk" if args.loadgen == "wrk" or (args.loadgen == "auto" and wrk) else "python"
    if gen == "wrk" and wrk is None:
        raise SystemExit("--loadgen wrk: wrk is not installed (Debian: apt-get install -y wrk)")
    bench = Bench(args)
    started = time.time()
    load_before = loadavg()
    try:
        bench.start_backends()
        targets, extra = start_targets(bench, args)
        cal = calibrate(bench, wrk) if args.calibrate else None
        points = measure_all(bench, targets, extra, gen, wrk)
        extras = {} if args.no_extras else measure_extras(bench, targets)
    finally:
        bench.stop_all()
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "python": sys.version.split()[0],
        },
        "loadgen": gen,
        "duration_s_per_point": args.duration,
        "backends": args.backends,
        "stream_chunks": args.stream_chunks,
        "calibration": cal,
        "points": [asdict(p) for p in points],
        "extras": extras,
        "summary": summary(points, extras, max(args.concurrency)),
        "skipped": bench.skipped,
        "notes": {t.name: t.note for t in targets + extra},
        "elapsed_s": round(time.time() - started, 1),
    }
    print_report(result, points, bench.skipped)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
