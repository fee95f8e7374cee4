"""Store round trips on the hot path: one to reserve and one to release, nothing per request
for the fleet view. Black box: a real gateway on a real redis-server, counted with MONITOR."""

from __future__ import annotations

import argparse

from loadtest.bench.overhead_extras import store_round_trips
from loadtest.bench.overhead_targets import Bench


def test_one_reserve_and_one_release_per_request() -> None:
    bench = Bench(
        argparse.Namespace(
            backends=2, stream_chunks=8, policy="kvroute", duration=1.0, wrk_threads=1
        )
    )
    try:
        bench.start_backends()
        gw = bench.kvroute("kvroute-redis", redis=True)
        assert bench.redis is not None
        n = 120
        got = store_round_trips(gw.url, bench.redis.url, n=n, concurrency=4)
    finally:
        bench.stop_all()
    for mode in ("json", "sse"):
        cmds = got[mode]["commands"]
        # Every request reserved (a script call) and released (HDEL) once; a release of the
        # readiness probe's request may land inside the window.
        assert n <= cmds.get("HDEL", 0) <= n + 2, got
        # Reserve scripts, plus the fleet view's reads: those follow time, not requests.
        assert n <= cmds.get("EVALSHA", 0) <= n + n // 4, got
        assert got[mode]["per_request"] <= 2.5, got
