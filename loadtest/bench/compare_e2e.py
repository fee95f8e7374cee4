"""End-to-end comparison: the same workload through the real gateway, round robin vs kvroute.

Starts a local fleet (``loadtest.local_fleet``): four simulated engines with contiguous KV
allocators, two of them in a ``long`` pool, and the gateway (embedded store, or Redis with
``--redis``). For each policy it restarts every engine (``POST /admin/restart``: empty
allocators, uptime zero), starts the gateway with that policy, and sends the identical
request list (same seed, same arrival times; ``loadtest.bench.driver``) open-loop. Then it reads
what happened from three places: the engines' own allocation-failure counters (every
refused attempt, diverted ones included), the gateway's ``/metrics`` (allocation failures
by cause, and those while the fleet had more than 25% free memory: false capacity
exhaustion), and the client's view (final failures by status and error cause, goodput,
latency percentiles).

    python -m loadtest.bench.compare_e2e --requests 400 --rate 25 --seed 7 --json out/e2e.json
    python -m loadtest.bench.compare_e2e --trace ../shared/data/AzureLLMInferenceTrace_code.csv \\
        --length-scale 4 --rate-scale 2 --limit 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.driver import RunStats, drive
from loadtest.local_fleet import EngineSpec, LocalFleet
from loadtest.workload import Request, bimodal, load_trace, summary

ENGINE_FAILURES = "kvroute_engine_allocation_failures_total"
GW_FAILURES = "kvroute_allocation_failures_total"
GW_HIGH_FREE = "kvroute_allocation_failures_at_high_free_memory_total"
GW_REQUESTS = "kvroute_requests_total"
GW_RETRIES = "kvroute_retries_total"


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page as (name, labels, value)."""
    text = httpx.get(url, timeout=5.0).text
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **match: str) -> float:
    return sum(
        v
        for n, labels, v in samples
        if n == name and all(labels.get(k) == m for k, m in match.items())
    )


def build_workload(args: argparse.Namespace) -> list[Request]:
    if args.trace:
        return load_trace(
            args.trace, args.length_scale, args.rate_scale, limit=args.limit or args.requests
        )
    return bimodal(args.rate, n=args.requests, seed=args.seed)


def latency_pct(stats: RunStats, q: float) -> float | None:
    v = stats.latency_pct(q)
    return None if v != v else round(v, 3)  # NaN: nothing succeeded


def run_policy(
    fleet: LocalFleet, policy: str, requests: list[Request], args: argparse.Namespace
) -> dict[str, Any]:
    fleet.stop_gateway()
    fleet.restart_engines()
    fleet.start_gateway(policy)
    t0 = time.monotonic()
    stats = asyncio.run(drive(fleet.gateway_url, requests, seed=args.seed, timeout_s=args.timeout))
    wall = time.monotonic() - t0
    time.sleep(0.3)  # let background releases and the last scrape land
    gw = scrape(fleet.gateway_url + "/metrics")
    engines = {
        spec.name: total(scrape(p.url + "/metrics"), ENGINE_FAILURES)
        for spec, p in zip(fleet.specs, fleet.engines, strict=True)
    }
    failed = [r for r in stats.results if r.status != 200]
    causes = Counter(f"{r.status} {r.cause or r.error_code or '-'}" for r in failed)
    long_failed, long_n = stats.failed_of("long")
    short_failed, short_n = stats.failed_of("short")
    n = len(stats.results)
    return {
        "policy": policy,
        "requests": n,
        "ok": stats.ok,
        "final_failures": stats.failed,
        "final_failure_rate": round(stats.failed / n, 4) if n else 0.0,
        "long_failures": long_failed,
        "long_requests": long_n,
        "short_failures": short_failed,
        "short_requests": short_n,
        "final_failures_by_cause": dict(causes.most_common()),
        "engine_allocation_failures": int(sum(engines.values())),
        "engine_allocation_failures_by_engine": {k: int(v) for k, v in engines.items()},
        "gateway_allocation_failures": {
            "fragmentation": int(total(gw, GW_FAILURES, cause="fragmentation")),
            "capacity": int(total(gw, GW_FAILURES, cause="capacity")),
        },
        "false_capacity_failures": int(total(gw, GW_HIGH_FREE)),
        "retries_diverted": int(total(gw, GW_RETRIES)),
        "extra_attempts": stats.extra_attempts,
        "goodput_tokens_per_s": round(stats.goodput_tokens_per_s(), 1),
        "latency_s": {
            "p50": latency_pct(stats, 0.5),
            "p90": latency_pct(stats, 0.9),
            "p99": latency_pct(stats, 0.99),
        },
        "wall_s": round(wall, 2),
    }


def _pct(a: float, b: float) -> str:
    return f"{(b - a) / a:+.0%}" if a else "-"


def print_report(res: dict[str, Any]) -> None:
    w = res["workload"]
    print(
        f"workload: {w['source']}, {w['n']} requests, {w['long_share']:.0%} long, mean prompt {w['mean_prompt']:.0f} tokens, "
        f"{w['rate_per_s']:.1f} req/s offered; engines: {res['fleet']}"
    )
    rows = res["runs"]
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("final failures", lambda r: f"{r['final_failures']} ({r['final_failure_rate']:.1%})"),
        ("long failed", lambda r: f"{r['long_failures']}/{r['long_requests']}"),
        ("short failed", lambda r: f"{r['short_failures']}/{r['short_requests']}"),
        ("alloc failures at engines", lambda r: str(r["engine_allocation_failures"])),
        (
            "gateway: fragmentation",
            lambda r: str(r["gateway_allocation_failures"]["fragmentation"]),
        ),
        ("gateway: capacity", lambda r: str(r["gateway_allocation_failures"]["capacity"])),
        ("false capacity (>25% free)", lambda r: str(r["false_capacity_failures"])),
        ("diverted retries", lambda r: str(r["retries_diverted"])),
        ("goodput tok/s", lambda r: f"{r['goodput_tokens_per_s']:,.0f}"),
        ("latency p50 s", lambda r: str(r["latency_s"]["p50"])),
        ("latency p90 s", lambda r: str(r["latency_s"]["p90"])),
        ("latency p99 s", lambda r: str(r["latency_s"]["p99"])),
    ]
    width = max(len(c[0]) for c in cols)
    print("\n" + " " * width + "".join(f"{r['policy']:>16}" for r in rows))
    for name, fn in cols:
        print(f"{name:<{width}}" + "".join(f"{fn(r):>16}" for r in rows))
    for r in rows:
        if r["final_failures_by_cause"]:
            print(
                f"{r['policy']}: final failures by status and cause: {r['final_failures_by_cause']}"
            )
    if "change" in res:
        c = res["change"]
        print(
            f"\n{res['policies'][1]} vs {res['policies'][0]}: engine allocation failures {c['engine_allocation_failures']}, "
            f"final failures {c['final_failures']}, false-capacity failures {c['false_capacity_failures']}, goodput {c['goodput']}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench compare",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--requests", type=int, default=400, help="requests per run (default 400)")
    p.add_argument(
        "--rate",
        type=float,
        default=25.0,
        help="arrivals per second for the bimodal mix (default 25)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--trace",
        default=None,
        help="replay a trace (Azure CSV or JSONL) instead of the bimodal mix",
    )
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply trace prompt lengths")
    p.add_argument(
        "--rate-scale", type=float, default=1.0, help="replay the trace this many times faster"
    )
    p.add_argument(
        "--limit", type=int, default=None, help="first N trace rows (default: --requests)"
    )
    p.add_argument(
        "--policies",
        default="round_robin,kvroute",
        help="comma list, run in this order (default round_robin,kvroute)",
    )
    p.add_argument("--capacity-tokens", type=int, default=100_000)
    p.add_argument(
        "--speedup", type=float, default=10.0, help="engine time acceleration (default 10)"
    )
    p.add_argument("--long-engines", type=int, default=2)
    p.add_argument("--general-engines", type=int, default=2)
    p.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help="gateway retry.max_attempts for every run (default: config default)",
    )
    p.add_argument(
        "--redis", action="store_true", help="use a local redis-server as the gateway's store"
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="client timeout per request, seconds"
    )
    p.add_argument(
        "--json", dest="json_out", default=None, help="write the results as JSON to this file"
    )
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    policies = [p for p in args.policies.split(",") if p]
    requests = build_workload(args)
    if not requests:
        raise SystemExit("the workload is empty")
    specs = [
        EngineSpec(f"long-{i}", "long", capacity_tokens=args.capacity_tokens, speedup=args.speedup)
        for i in range(args.long_engines)
    ]
    specs += [
        EngineSpec(
            f"general-{i}", "general", capacity_tokens=args.capacity_tokens, speedup=args.speedup
        )
        for i in range(args.general_engines)
    ]
    overrides: dict[str, Any] = {}
    if args.max_attempts is not None:
        overrides["retry"] = {"max_attempts": args.max_attempts}
    fleet = LocalFleet(specs, use_redis=args.redis, config_overrides=overrides)
    runs = []
    started = time.time()
    try:
        if args.redis:
            fleet.start_redis()
        fleet.start_engines()
        for policy in policies:
            runs.append(run_policy(fleet, policy, requests, args))
    finally:
        fleet.stop()
    w = summary(requests)
    res: dict[str, Any] = {
        "workload": {
            "source": f"trace {args.trace}" if args.trace else f"bimodal seed {args.seed}",
            **w,
        },
        "fleet": f"{args.long_engines} long + {args.general_engines} general contiguous engines, {args.capacity_tokens:,} tokens each, speedup {args.speedup:g}, "
        + ("Redis store" if args.redis else "embedded store"),
        "policies": policies,
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "elapsed_s": round(time.time() - started, 1),
    }
    if len(runs) == 2:
        a, b = runs
        res["change"] = {
            "engine_allocation_failures": _pct(
                a["engine_allocation_failures"], b["engine_allocation_failures"]
            ),
            "final_failures": _pct(a["final_failures"], b["final_failures"]),
            "false_capacity_failures": _pct(
                a["false_capacity_failures"], b["false_capacity_failures"]
            ),
            "goodput": _pct(a["goodput_tokens_per_s"], b["goodput_tokens_per_s"]),
        }
    print_report(res)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
