"""The overhead benchmark's other figures: store round trips per request, 1 vs 2 workers,
and the routing decision for 30k-token prompts with the event loop's lag under a long mix.

- Round trips: Redis's ``total_reads_processed`` (one per batch the server reads off a client
  socket: a pipeline or a script call counts once, the commands a script runs inside count
  nothing) over N requests, less what the gateway's background work (scrapes, snapshot
  reads) costs over the same time idle.
- Workers: ``kvroute serve --workers 1`` and ``--workers 2`` on one Redis, same load, side by side.
- Decision and lag: the real app in this process (no HTTP server: the loop measured is the
  gateway's), trivial backends over the network; the ``kvroute_routing_decision_seconds``
  observations are collected raw, and a probe task measures how late a 1 ms sleep wakes.
"""

from __future__ import annotations

import asyncio
import collections
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.bench.overhead_load import CHAT_PATH, MODEL, request_body
from loadtest.workload import make_prompt


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _fire(url: str, n: int, concurrency: int, stream: bool) -> None:
    body = request_body(stream)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with (
                sem,
                s.post(
                    url + CHAT_PATH, data=body, headers={"content-type": "application/json"}
                ) as r,
            ):
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"round-trip run: HTTP {r.status}")

        await asyncio.gather(*(one() for _ in range(n)))


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


# ------------------------------------------------------------------ decision time and loop lag


def _long_body(tokens: int, rng: random.Random) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(tokens, rng)}],
            "max_tokens": 16,
        }
    )


async def _decision_and_lag(
    cfg_path: Path, long_tokens: int, n_long: int, mix_n: int, long_share: float
) -> dict[str, Any]:
    from proxy.api.app import create_app
    from proxy.config import load_config

    app = create_app(load_config(cfg_path))
    rng = random.Random(7)
    transport = __import__("httpx").ASGITransport(app=app)
    import httpx

    async with app.router.lifespan_context(app):
        rt = app.state.rt
        seen: list[float] = []
        observe = rt.metrics.decision.observe

        # Collected raw as well as into the histogram (the gateway's own measurement).
        def observe_both(v: float) -> None:
            seen.append(v)
            observe(v)

        rt.metrics.decision.observe = observe_both
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as c:

            async def send(body: bytes) -> None:
                r = await c.post(
                    CHAT_PATH, content=body, headers={"content-type": "application/json"}
                )
                if r.status_code != 200:
                    raise RuntimeError(f"decision run: HTTP {r.status_code}: {r.text[:200]}")

            await send(request_body(False))
            # Each prompt is new text: no cached count helps.
            bodies = [_long_body(long_tokens, rng) for _ in range(n_long)]
            seen.clear()
            for b in bodies:
                await send(b)
            alone = list(seen)
            # The mix: long_share of the requests long, at concurrency 8, a lag probe running.
            mix = [
                _long_body(long_tokens, rng) if rng.random() < long_share else request_body(False)
                for _ in range(mix_n)
            ]
            lags: list[float] = []
            stop = asyncio.Event()

            async def probe() -> None:
                loop = asyncio.get_running_loop()
                while not stop.is_set():
                    t = loop.time()
                    await asyncio.sleep(0.001)
                    lags.append(loop.time() - t - 0.001)

            sem = asyncio.Semaphore(8)

            async def guarded(b: bytes) -> None:
                async with sem:
                    await send(b)

            # The same probe with no requests: what this shared machine alone adds.
            task = asyncio.ensure_future(probe())
            await asyncio.sleep(1.0)
            stop.set()
            await task
            idle_lags, lags = list(lags), []
            stop.clear()
            seen.clear()
            task = asyncio.ensure_future(probe())
            await asyncio.gather(*(guarded(b) for b in mix))
            stop.set()
            await task
            in_mix = list(seen)
    return {
        "long_tokens": long_tokens,
        "decision_ms_p50_alone": round(statistics.median(alone) * 1e3, 2),
        "decision_ms_p99_alone": round(_pct(alone, 0.99) * 1e3, 2),
        "mix_requests": mix_n,
        "mix_long_share": long_share,
        "decision_ms_p50_mix": round(statistics.median(in_mix) * 1e3, 2),
        "decision_ms_p99_mix": round(_pct(in_mix, 0.99) * 1e3, 2),
        "idle_loop_lag_ms_p99": round(_pct(idle_lags, 0.99) * 1e3, 2),
        "loop_lag_ms_p50": round(statistics.median(lags) * 1e3, 2),
        "loop_lag_ms_p99": round(_pct(lags, 0.99) * 1e3, 2),
    }


def decision_and_lag(
    cfg_path: Path,
    long_tokens: int = 30_000,
    n_long: int = 10,
    mix_n: int = 60,
    long_share: float = 0.3,
) -> dict[str, Any]:
    return asyncio.run(_decision_and_lag(cfg_path, long_tokens, n_long, mix_n, long_share))
