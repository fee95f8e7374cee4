"""What forgotten reservations cost the Redis store's reserve and fleet read.

A reserve whose outcome is unknown (cut off by its deadline, its request cancelled while the
call was in flight) is released with ``forget``, which keeps the id refused for the
reservation TTL (15 minutes by default) so that a late copy of the reserve leaves nothing
behind. Under a slow or briefly frozen Redis they pile up on a backend. This benchmark puts
``N`` of them on one backend of a fresh ``redis-server`` and measures, for each ``N``:

* a reserve (then its release), one at a time: the client's p50 and Redis's own CPU per
  call (``INFO commandstats``, the evalsha line);
* the request path's fleet read, the same way.

Each ratio is against ``N = 0`` measured in the same run. Redis runs every backend's reserves
on one core, so its CPU per call is what caps a fleet's reserves per second.

    python -m loadtest.lab store-forgotten --counts 0,1000,5000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis as redis_lib

from loadtest.local_fleet import redis_proc
from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state.redis_store import RedisStore

NAME = "n1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.lab store-forgotten", description=__doc__)
    p.add_argument(
        "--counts", default="0,1000,5000", help="forgotten ids on the backend, comma-separated"
    )
    p.add_argument("--calls", type=int, default=400, help="reserves (and reads) measured per count")
    p.add_argument("--json", type=Path)
    return p


def _evalsha_us(r: redis_lib.Redis) -> float:
    stats: dict[str, Any] = r.info("commandstats").get("cmdstat_evalsha") or {}
    return float(stats.get("usec_per_call", 0.0))


async def measure(url: str, forgotten: int, calls: int) -> dict[str, float]:
    """One count: a fresh key prefix, ``forgotten`` ids forgotten, then reserves and reads."""
    r = redis_lib.Redis.from_url(url)
    store = RedisStore(StoreConfig(redis_url=url, key_prefix=f"bench{forgotten}", op_timeout_s=5.0))
    try:
        now = store.now()
        report = MemoryReport(
            capacity_tokens=1_000_000,
            free_tokens=1_000_000,
            largest_free_block_tokens=1_000_000,
            reported_at=now,
        )
        await store.put_report(NAME, report, ttl_s=600.0)
        for i in range(forgotten):
            await store.forget(NAME, f"cut-{i}", now + 900.0)
        await store.reserve(NAME, "warm", 1, store.now(), 60.0)  # scripts loaded, pool warm
        await store.release(NAME, "warm")
        r.config_resetstat()
        reserve_s: list[float] = []
        for i in range(calls):
            t = time.perf_counter()
            await store.reserve(NAME, f"live-{i}", 100, store.now(), 60.0)
            reserve_s.append(time.perf_counter() - t)
            await store.release(NAME, f"live-{i}")
        reserve_redis_us = _evalsha_us(r)
        r.config_resetstat()
        read_s: list[float] = []
        for _ in range(calls):
            t = time.perf_counter()
            await store.read([NAME], store.now())
            read_s.append(time.perf_counter() - t)
        return {
            "forgotten": forgotten,
            "reserve_p50_ms": statistics.median(reserve_s) * 1e3,
            "reserve_redis_us": reserve_redis_us,
            "read_p50_ms": statistics.median(read_s) * 1e3,
            "read_redis_us": _evalsha_us(r),
        }
    finally:
        await store.close()
        r.close()


def print_rows(rows: list[dict[str, float]]) -> None:
    base = rows[0]
    print(
        f"{'forgotten':>9} {'reserve p50 ms':>14} {'Redis us':>9} {'x none':>7}"
        f" {'read p50 ms':>11} {'Redis us':>9} {'x none':>7}"
    )
    for row in rows:
        print(
            f"{row['forgotten']:>9.0f} {row['reserve_p50_ms']:>14.3f} {row['reserve_redis_us']:>9.1f}"
            f" {row['reserve_redis_us'] / max(base['reserve_redis_us'], 1e-9):>7.2f}"
            f" {row['read_p50_ms']:>11.3f} {row['read_redis_us']:>9.1f}"
            f" {row['read_redis_us'] / max(base['read_redis_us'], 1e-9):>7.2f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if 0 not in counts:
        counts.insert(0, 0)  # the baseline every ratio is against
    counts.sort()
    with tempfile.TemporaryDirectory(prefix="kvroute-forgotten-") as tmp:
        proc = redis_proc(Path(tmp))
        proc.start(log_dir=Path(tmp))
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis_lib.Redis.from_url(proc.url).ping()
                    break
                except redis_lib.RedisError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            rows = [asyncio.run(measure(proc.url, n, args.calls)) for n in counts]
        finally:
            proc.stop(timeout_s=5)
    print_rows(rows)
    if args.json:
        import orjson

        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
