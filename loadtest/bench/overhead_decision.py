"""The routing decision for 30k-token prompts, and the gateway's event-loop lag under a long mix.

The gateway runs in this process on its real server stack (uvicorn with the guarded
httptools protocol, as ``kvroute serve`` runs it), trivial backends over the network; the
load comes from a separate client process, so the loop that is measured carries only the
gateway's work: reading and parsing the bodies, sizing, ranking, forwarding. (The earlier
version called the app through httpx's ASGI transport in the same loop, which put the
client's own work, about a third of the loop's busy time, into the gateway's lag.)

- decision: the gateway's own ``kvroute_routing_decision_seconds`` observations (request
  start to the first ranking), collected raw; each long prompt is new text, so no cached
  count helps; "alone" sends them one at a time. ``sizing_cpu_ms_p50_alone``: the CPU time
  of each alone prompt's sizing call in its thread (with a split encode, the other half's
  thread is not included), steadier than wall time on a shared box.
- lag: a probe task in the gateway's loop measures how late a 1 ms sleep wakes, while the
  client sends the mix (``long_share`` long, the rest tiny, at concurrency 8), and for as
  long with no load at all (what the machine alone adds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from loadtest.bench.overhead_load import MODEL, post_ok, request_body
from loadtest.workload import make_prompt


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def long_body(tokens: int, rng: random.Random) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(tokens, rng)}],
            "max_tokens": 16,
        }
    )


# ------------------------------------------------------------------ the client process


async def _client(url: str, bodies: list[bytes], concurrency: int) -> None:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        # The connection pool warmed first.
        await post_ok(s, sem, url, request_body(False), "decision run")
        print("go", flush=True)
        await asyncio.gather(*(post_ok(s, sem, url, b, "decision run") for b in bodies))
        print("done", flush=True)


def client_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="send the bodies of a file (orjson list) to a gateway")
    p.add_argument("url")
    p.add_argument("bodies", type=Path)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args(argv)
    bodies = [s.encode() for s in orjson.loads(a.bodies.read_bytes())]
    asyncio.run(_client(a.url, bodies, a.concurrency))


# ------------------------------------------------------------------ the gateway side


async def _send(
    url: str, bodies: list[bytes], concurrency: int, workdir: Path
) -> tuple[float, float]:
    """Send ``bodies`` from a client process; the loop times of its first and last request."""
    path = workdir / f"bodies-{time.monotonic_ns()}.json"
    path.write_bytes(orjson.dumps([b.decode() for b in bodies]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtest.bench.overhead_decision",
        url,
        str(path),
        "--concurrency",
        str(concurrency),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    start = end = 0.0
    async for line in proc.stdout:
        if line.strip() == b"go":
            start = time.perf_counter()
        elif line.strip() == b"done":
            end = time.perf_counter()
    if await proc.wait() != 0 or not end:
        raise RuntimeError("decision run: the client process failed")
    path.unlink()
    return start, end


async def _decision_and_lag(
    cfg_path: Path, long_tokens: int, n_long: int, mix_n: int, long_share: float
) -> dict[str, Any]:
    import uvicorn

    from proxy.api.app import create_app
    from proxy.api.server import server_config
    from proxy.config import load_config
    from proxy.gateway import sizing_pool

    cfg = load_config(cfg_path)
    app = create_app(cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        server_config(app, cfg, "127.0.0.1", port, log_level="warning", lifespan="on")
    )
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    # uvicorn offers a flag, not an event, for "listening".
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    lags: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def probe() -> None:
        # perf_counter, not loop.time(): uvloop's clock has millisecond resolution.
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((t, time.perf_counter() - t - 0.001))

    try:
        rt = app.state.rt
        seen: list[float] = []
        observe = rt.metrics.decision.observe

        # Collected raw as well as into the histogram (the gateway's own measurement).
        def observe_both(v: float) -> None:
            seen.append(v)
            observe(v)

        rt.metrics.decision.observe = observe_both
        # CPU of each call in a sizing thread (steadier than wall time on a busy box): since
        # the chunk cache, a big request's thread work is encoding its new chunks.
        cpu: list[float] = []
        run_in_thread = sizing_pool.run

        async def timed_run(fn: Any, *args: Any) -> Any:
            def timed(*inner: Any) -> Any:
                c = time.thread_time()
                try:
                    return fn(*inner)
                finally:
                    cpu.append(time.thread_time() - c)

            return await run_in_thread(timed, *args)

        sizing_pool.run = timed_run
        workdir = cfg_path.parent
        # Each prompt is new text: no cached count helps.
        await _send(url, [long_body(long_tokens, rng) for _ in range(n_long)], 1, workdir)
        alone = list(seen[-n_long:])
        # Routed on their bound (sizing.route_on_bound), their exact counts may still run.
        await _counts_done()
        alone_cpu = list(cpu)
        mix = [
            long_body(long_tokens, rng) if rng.random() < long_share else request_body(False)
            for _ in range(mix_n)
        ]
        task = asyncio.ensure_future(probe())
        seen.clear()
        start, end = await _send(url, mix, 8, workdir)
        in_mix = list(seen[1:])  # the first is the client's warm-up request
        t_idle = time.perf_counter()
        await asyncio.sleep(min(end - start, 3.0))
        stop.set()
        await task
    finally:
        sizing_pool.run = run_in_thread
        server.should_exit = True
        await serving
    busy = [lag for t, lag in lags if start <= t <= end]
    idle = [lag for t, lag in lags if t >= t_idle]
    return {
        "long_tokens": long_tokens,
        "decision_ms_p50_alone": round(statistics.median(alone) * 1e3, 2),
        "decision_ms_p99_alone": round(_pct(alone, 0.99) * 1e3, 2),
        "sizing_cpu_ms_p50_alone": round(statistics.median(alone_cpu) * 1e3, 2),
        "mix_requests": mix_n,
        "mix_long_share": long_share,
        "decision_ms_p50_mix": round(statistics.median(in_mix) * 1e3, 2),
        "decision_ms_p99_mix": round(_pct(in_mix, 0.99) * 1e3, 2),
        "idle_loop_lag_ms_p99": round(_pct(idle, 0.99) * 1e3, 2),
        "loop_lag_ms_p50": round(statistics.median(busy) * 1e3, 2),
        "loop_lag_ms_p99": round(_pct(busy, 0.99) * 1e3, 2),
    }


async def _counts_done(timeout_s: float = 60.0) -> None:
    """Until no exact count runs behind a request routed on its bound (bounded)."""
    from proxy.gateway import bound_route

    deadline = time.perf_counter() + timeout_s
    # A counter, not an event, says how many are running.
    while bound_route.pending() and time.perf_counter() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


def decision_and_lag(
    cfg_path: Path,
    long_tokens: int = 30_000,
    n_long: int = 10,
    mix_n: int = 60,
    long_share: float = 0.3,
) -> dict[str, Any]:
    """Decision time alone and in the mix, and the gateway loop's lag (see the module doc)."""
    runner: Any = asyncio.run
    if os.environ.get("KVROUTE_BENCH_LOOP", "uvloop") == "uvloop":
        # As ``kvroute serve`` runs; KVROUTE_BENCH_LOOP=asyncio for asyncio's debug tools.
        import uvloop

        runner = uvloop.run
    return dict(runner(_decision_and_lag(cfg_path, long_tokens, n_long, mix_n, long_share)))


if __name__ == "__main__":
    client_main()
