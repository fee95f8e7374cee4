"""The overhead benchmark's other figures: store round trips per request and 1 vs 2 workers
(the routing decision and the loop's lag: ``loadtest.bench.overhead_decision``).

- Round trips: Redis's ``total_reads_processed`` (one per batch the server reads off a client
  socket: a pipeline or a script call counts once, the commands a script runs inside count
  nothing) over N requests, less what the gateway's background work (scrapes, snapshot
  reads) costs over the same time idle.
- Workers: ``kvroute serve --workers 1`` and ``--workers 2`` on one Redis, same load, side by side.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp

from loadtest.bench.overhead_load import post_ok, request_body


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _fire(url: str, n: int, concurrency: int, stream: bool) -> None:
    body = request_body(stream)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(post_ok(s, sem, url, body, "round-trip run") for _ in range(n)))


class _Monitor:
    """Redis MONITOR in a thread: counts the commands clients send (a script's own calls, which
    MONITOR tags ``lua``, are not round trips; a pipeline's commands are listed one by one)."""

    def __init__(self, redis_url: str) -> None:
        import threading

        import redis as redis_lib

        self._conn = redis_lib.Redis.from_url(redis_url)
        self._mon = self._conn.monitor()  # type: ignore[no-untyped-call]
        self._mon.__enter__()
        self.commands: collections.Counter[str] = collections.Counter()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            while not self._stop:
                cmd = self._mon.next_command()
                if cmd.get("client_type") == "lua":
                    continue
                name = str(cmd.get("command", "")).split(" ", 1)[0].upper()
                if name and name != "PING":
                    self.commands[name] += 1

    def count(self) -> int:
        return sum(self.commands.values())

    def close(self) -> None:
        import contextlib

        self._stop = True
        # One more command wakes the reader so that it sees the stop flag.
        with contextlib.suppress(Exception):
            self._conn.ping()
        self._thread.join(2)
        with contextlib.suppress(Exception):
            self._mon.__exit__(None, None, None)


def store_round_trips(
    url: str, redis_url: str, n: int = 400, concurrency: int = 8
) -> dict[str, Any]:
    """Commands the gateway at ``url`` sends Redis per request, background work excluded.

    A script call is one command (and one round trip); MULTI...EXEC counts each command.
    The background (scrapes, snapshot reads) is measured idle for as long and subtracted.
    """
    out: dict[str, Any] = {"requests": n}
    # Warm the gateway's Redis pool to this concurrency first: opening a connection costs
    # commands of its own (HELLO, CLIENT SETNAME), once per connection, not per request.
    asyncio.run(_fire(url, max(concurrency * 4, n // 4), concurrency, False))
    time.sleep(0.3)
    for mode in ("json", "sse"):
        mon = _Monitor(redis_url)
        try:
            time.sleep(0.2)
            c0, t0 = mon.count(), time.monotonic()
            asyncio.run(_fire(url, n, concurrency, mode == "sse"))
            # Releases run just after the answer: let them land before reading the count.
            time.sleep(0.3)
            busy, busy_s = mon.count() - c0, time.monotonic() - t0
            by_command = collections.Counter(mon.commands)
            i0, t1 = mon.count(), time.monotonic()
            time.sleep(min(busy_s, 1.0))
            idle_rate = (mon.count() - i0) / (time.monotonic() - t1)
        finally:
            mon.close()
        out[mode] = {
            "per_request": round((busy - idle_rate * busy_s) / n, 2),
            "raw_per_request": round(busy / n, 2),
            "background_per_s": round(idle_rate, 1),
            "commands": dict(by_command.most_common(6)),
        }
    return out
