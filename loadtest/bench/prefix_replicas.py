"""Is sharing the prefix index between gateway replicas worth it? Two replicas, with and without.

The shared-document workload (``loadtest.bench.prefix``) through two gateway replicas on one
Redis store, requests spread over them round robin (a plain load balancer: a conversation's
turns alternate replicas), four vLLM-mode engines (serial prefill, prefix cache); one fresh
fleet per row: one replica (the reference), two replicas each keeping its own index, two
replicas sharing it (``routing.prefix.share``). Measured as in ``loadtest.bench.prefix``:
the engines' prefix-cache hit rate, TTFT, and how many placements each replica learned.

    python -m loadtest.bench.prefix_replicas --json out/prefix_replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench.prefix import bodies, breakdown, drive, pct, scrape, wait_reported
from loadtest.local_fleet import EngineSpec, LocalFleet, Proc, free_port, wait_http
from loadtest.workload import SharedDocs, shared_documents

ROWS = (
    ("one replica", 1, False),
    ("two replicas, own index", 2, False),
    ("two replicas, shared index", 2, True),
)


def second_gateway(fleet: LocalFleet, config: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    argv += ["--port", str(port), "--log-level", "warning"]
    proc = Proc("gateway-2", argv, f"http://127.0.0.1:{port}")
    proc.start(log_dir=fleet.workdir)
    wait_http(proc.url + "/health", proc=proc.popen)
    return proc


def one_row(
    label: str, replicas: int, share: bool, w: SharedDocs, payloads: list[dict[str, Any]], args: Any
) -> dict[str, Any]:
    specs = [
        EngineSpec(f"e{i}", "general", "contiguous", args.capacity, args.speedup, 16,
                   ("--behaviour", "vllm", "--serial-prefill"))
        for i in range(4)
    ]  # fmt: skip
    fleet = LocalFleet(
        specs,
        use_redis=True,
        config_overrides={
            "routing": {"prefix": {"share": share}},
            "queue": {"max_wait_s": 20.0},
            "upstream": {"total_timeout_s": 120.0},
        },
    )
    extra: Proc | None = None
    try:
        fleet.start_redis()
        fleet.start_engines()
        fleet.config_overrides["backends"] = [
            {"name": s.name, "url": p.url, "kind": "vllm"}
            for s, p in zip(fleet.specs, fleet.engines, strict=True)
        ]
        fleet.start_gateway()
        urls = [fleet.gateway_url]
        if replicas > 1:
            extra = second_gateway(fleet, fleet.workdir / "kvroute-kvroute.yaml")
            urls.append(extra.url)
        for u in urls:
            wait_reported(u)
        t0 = time.monotonic()
        results = asyncio.run(drive(urls, w, payloads))
        wall = time.monotonic() - t0
        metrics = [scrape(p.url) for p in fleet.engines]
        split, _ = breakdown(results, metrics, None)
    finally:
        if extra is not None:
            extra.stop()
        fleet.stop()
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttfts = [r["ttft"] for r in ok]
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in metrics)
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in metrics)
    return {
        "label": label,
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        "known_doc_p50_ms": split["known doc p50 ms"],
        "failed": len(results) - len(ok),
        "requests": len(results),
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench prefix-replicas", description=__doc__
    )
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--capacity", type=int, default=200_000)
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    w = shared_documents(args.requests, args.rate, seed=args.seed)
    payloads = bodies(w)
    rows = []
    for label, replicas, share in ROWS:
        row = one_row(label, replicas, share, w, payloads, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| gateways | hit rate | TTFT p50 ms | TTFT p99 ms | known-doc TTFT p50 ms | failed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['known_doc_p50_ms']:.0f} | {r['failed']}/{r['requests']} |"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
