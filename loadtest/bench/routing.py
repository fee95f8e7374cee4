"""Routing decision cost incl. tokenization, and event-loop lag while long prompts are tokenized.

In-process, no network: the pieces the gateway runs before it forwards a request, timed one
by one at 200 / 2,000 / 30,000 prompt tokens (chat bodies built by
``loadtest.workload.make_prompt``, so the token counts are exact):

- parse: ``orjson.loads`` of the raw body (``json.loads`` beside it, for the record);
- tokenize: ``proxy.gateway.sizing.count_prompt`` inline, and ``count_prompt_async`` (a worker
  thread above ``tokenize_in_thread_chars``), each on fresh text (no cached count helps);
- size as the gateway: ``proxy.gateway.sizing.size_request`` with the default config (prefix
  affinity on): the count and the prompt's block hashes from one encode, in one worker-thread
  hop for big prompts, on fresh text; this is the decision's sizing step;
- rank: every policy of ``proxy.routing.policy`` on a 16-node snapshot (4 long-pool nodes, 12
  general, various fragmentation).

Ratios are against the 200-token decision measured in the same run. Then a ticker task
(every 1 ms) measures how late the event loop wakes it while 30,000-token prompts are
counted, inline vs off the loop, against the same ticker on an idle loop.

    python -m loadtest.bench.routing --json out/routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from loadtest.workload import chat_overhead_tokens, make_prompt
from proxy.config import Config, RoutingConfig, parse_config
from proxy.core import tokens
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.validation import ParsedRequest, parse_request
from proxy.gateway import sizing
from proxy.routing import POLICIES, PolicySettings, RouteRequest, classify, make_policy

SIZES = (200, 2_000, 30_000)
DEFAULT_THREAD_CHARS: int = RoutingConfig.model_fields["tokenize_in_thread_chars"].default
LONG_THRESHOLD = 8_000


def chat_body(prompt_tokens: int, seed: int = 0) -> dict[str, Any]:
    text = make_prompt(max(1, prompt_tokens - chat_overhead_tokens()), random.Random(seed))
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 256,
    }


def fleet_snapshot(now: float, n: int = 16, seed: int = 0) -> FleetSnapshot:
    """A 16-node fleet in a plausible mid-life state: every node reporting, several fragmented."""
    rng = random.Random(seed)
    nodes = []
    cap = 100_000
    for i in range(n):
        role = "long" if i < n // 4 else "general"
        free = rng.randint(20_000, 80_000)
        largest = rng.randint(max(1, free // 10), free)
        report = MemoryReport(
            capacity_tokens=cap,
            free_tokens=free,
            largest_free_block_tokens=largest,
            allocator="contiguous",
            block_size=16,
            running=rng.randint(0, 40),
            waiting=rng.randint(0, 3),
            started_at=now - rng.uniform(60, 6 * 86_400),
            reported_at=now - rng.uniform(0, 0.5),
        )
        overlay = Overlay(
            pending_tokens=rng.randint(0, 2_000),
            reserved_tokens=rng.randint(0, 30_000),
            inflight=rng.randint(0, 20),
        )
        nodes.append(
            NodeView(
                name=f"node-{i:02d}",
                pool="long" if role == "long" else "general",
                role="long" if role == "long" else "general",
                report=report,
                overlay=overlay,
            )
        )
    return FleetSnapshot(tuple(nodes), taken_at=now)


def time_us(fn: Callable[[], object], min_time_s: float, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of one call, each repeat running at least min_time_s/repeats."""
    fn()  # warm
    per_repeat = min_time_s / repeats
    results = []
    for _ in range(repeats):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= per_repeat:
                break
        results.append(el / n * 1e6)
    return statistics.median(results)


def atime_us(make: Callable[[], Awaitable[object]], min_time_s: float, repeats: int = 5) -> float:
    async def go() -> float:
        await make()
        per_repeat = min_time_s / repeats
        results = []
        for _ in range(repeats):
            n = 0
            t0 = time.perf_counter()
            while True:
                await make()
                n += 1
                el = time.perf_counter() - t0
                if el >= per_repeat:
                    break
            results.append(el / n * 1e6)
        return statistics.median(results)

    return asyncio.run(go())


def cold_tokenizer_load_ms() -> float | None:
    """First use of the encoder in this process (what the gateway's first request pays unless warmed)."""
    if tokens.encoding.cache_info().currsize:
        return None
    t0 = time.perf_counter()
    tokens.encoding()
    return (time.perf_counter() - t0) * 1000


_seed = 1000


def fresh_bodies(size: int, n: int) -> list[dict[str, Any]]:
    """``n`` chat bodies of ``size`` prompt tokens, each of text never used before (no cache hit)."""
    global _seed
    _seed += n
    return [chat_body(size, seed=_seed - n + i) for i in range(n)]


def gateway_config(thread_above_chars: int = DEFAULT_THREAD_CHARS) -> Config:
    """The default config (prefix affinity on) with this worker-thread threshold."""
    data = {
        "backends": [{"name": "b", "url": "http://127.0.0.1:1"}],
        "routing": {"tokenize_in_thread_chars": thread_above_chars},
    }
    cfg = parse_config(data, "bench", {})
    sizing.sizer_for(cfg)
    return cfg


def parsed_bodies(size: int, n: int) -> list[ParsedRequest]:
    return [parse_request(orjson.dumps(b), "chat", 10**7) for b in fresh_bodies(size, n)]


def fresh_us(fn: Callable[[dict[str, Any]], object], bodies: list[dict[str, Any]]) -> float:
    """Median time of ``fn`` over bodies it has not seen (each called once)."""
    out = []
    for b in bodies:
        t0 = time.perf_counter()
        fn(b)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def afresh_us(fn: Callable[[Any], Awaitable[object]], items: list[Any]) -> float:
    async def go() -> float:
        out = []
        for x in items:
            t0 = time.perf_counter()
            await fn(x)
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e6

    return asyncio.run(go())


def gateway_sizing_us(size: int, n: int) -> float:
    """``size_request`` as intake calls it, default config (prefix affinity on), fresh text."""
    cfg = parse_config({"backends": [{"name": "b", "url": "http://127.0.0.1:1"}]}, "bench", {})
    sizing.sizer_for(cfg)
    parsed = [parse_request(orjson.dumps(b), "chat", 10**7) for b in fresh_bodies(size, n + 1)]
    return afresh_us(lambda p: sizing.size_request(p, cfg), parsed[1:])


def decision_costs(min_time_s: float) -> list[dict[str, Any]]:
    now = time.time()
    snap = fleet_snapshot(now)
    settings = PolicySettings(long_threshold_tokens=LONG_THRESHOLD)
    policies = {name: make_policy(name, settings) for name in POLICIES}
    rows = []
    for size in SIZES:
        # Enough fresh texts for a stable median, bounded in time (30k tokens: ~10 ms each).
        n_fresh = max(5, min(200, int(min_time_s * 1e6 / (size * 0.25))))
        body = chat_body(size)
        raw = orjson.dumps(body)
        counted = sizing.count_prompt(body)
        demand = counted + int(body["max_tokens"])
        cls = classify(demand, LONG_THRESHOLD)
        req = RouteRequest(demand, cls)
        row: dict[str, Any] = {
            "prompt_tokens": size,
            "counted_tokens": counted,
            "body_bytes": len(raw),
            "class": cls,
            "parse_orjson_us": time_us(partial(orjson.loads, raw), min_time_s),
            "parse_json_us": time_us(partial(json.loads, raw), min_time_s),
            "tokenize_inline_us": fresh_us(sizing.count_prompt, fresh_bodies(size, n_fresh)),
            "tokenize_async_us": afresh_us(
                partial(sizing.count_prompt_async, thread_above_chars=DEFAULT_THREAD_CHARS),
                fresh_bodies(size, n_fresh),
            ),
            "size_gateway_us": gateway_sizing_us(size, n_fresh),
            "off_loop": len(body["messages"][0]["content"]) > DEFAULT_THREAD_CHARS,
        }
        for name, pol in policies.items():
            row[f"rank_{name}_us"] = time_us(partial(pol.rank, snap, req, now), min_time_s)
        row["decision_us"] = (
            row["parse_orjson_us"] + row["size_gateway_us"] + row["rank_kvroute_us"]
        )
        rows.append(row)
    base = rows[0]["decision_us"]
    for row in rows:
        row["decision_x_200"] = row["decision_us"] / base if base > 0 else None
        row["tokenize_share"] = (
            row["size_gateway_us"] / row["decision_us"] if row["decision_us"] > 0 else None
        )
    return rows


async def _lag_during(
    work: Callable[[], Awaitable[None]] | None, duration_s: float, tick_s: float = 0.001
) -> dict[str, Any]:
    """Run a 1 ms ticker beside `work` (or alone for `duration_s`) and report how late it woke."""
    lags: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            t0 = time.perf_counter()
            await asyncio.sleep(tick_s)
            lags.append(max(0.0, time.perf_counter() - t0 - tick_s))

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    if work is None:
        await asyncio.sleep(duration_s)
    else:
        await work()
    elapsed = time.perf_counter() - t0
    stop = True
    await task
    lags.sort()
    ms = [x * 1000 for x in lags]
    return {
        "elapsed_s": round(elapsed, 3),
        "ticks": len(ms),
        "lag_mean_ms": round(statistics.fmean(ms), 3) if ms else None,
        "lag_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3) if ms else None,
        "lag_max_ms": round(ms[-1], 3) if ms else None,
    }


def loop_lag(prompts: int, concurrency: int) -> dict[str, Any]:
    """Sized as the gateway sizes (count + prefix hashes), each prompt fresh text."""

    def tokenize_work(thread_above_chars: int) -> Callable[[], Awaitable[None]]:
        cfg = gateway_config(thread_above_chars)
        bodies = parsed_bodies(30_000, prompts)

        async def work() -> None:
            sem = asyncio.Semaphore(concurrency)

            async def one(p: ParsedRequest) -> None:
                async with sem:
                    await sizing.size_request(p, cfg)
                    await asyncio.sleep(0)

            await asyncio.gather(*(one(p) for p in bodies))

        return work

    async def go() -> dict[str, Any]:
        inline_work, off_work = tokenize_work(10**12), tokenize_work(DEFAULT_THREAD_CHARS)
        # Warm the thread pool and the encoder.
        await sizing.size_request(parsed_bodies(2_000, 1)[0], gateway_config(0))
        inline = await _lag_during(inline_work, 0)
        off = await _lag_during(off_work, 0)
        idle = await _lag_during(None, max(0.5, min(2.0, off["elapsed_s"])))
        return {"idle": idle, "inline": inline, "off_loop": off}

    out = asyncio.run(go())
    out["prompts"] = prompts
    out["prompt_tokens"] = 30_000
    out["concurrency"] = concurrency
    base = out["idle"]["lag_p99_ms"] or 0.0
    for k in ("inline", "off_loop"):
        out[k]["prompts_per_s"] = (
            round(prompts / out[k]["elapsed_s"], 1) if out[k]["elapsed_s"] > 0 else None
        )
        out[k]["lag_p99_x_idle"] = round(out[k]["lag_p99_ms"] / base, 1) if base > 0 else None
    return out


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(res: dict[str, Any]) -> None:
    if res["cold_tokenizer_load_ms"] is not None:
        print(
            f"cold tokenizer load (first encoding() in a process): {res['cold_tokenizer_load_ms']:.0f} ms"
        )
    print(f"one asyncio.to_thread hop (a no-op call): {res['thread_hop_us']:.1f} us")
    print("\n== routing decision cost (microseconds, median) ==")
    pols = [k[5:-3] for k in res["decisions"][0] if k.startswith("rank_")]
    head = (
        f"{'tokens':>7} {'bytes':>8} {'class':>6} {'orjson':>8} {'json':>8} {'tok inline':>10} {'tok async':>10} {'size gw':>9} "
        + " ".join(f"{'rank ' + p:>17}" for p in pols)
    )
    print(head + f" {'decision':>9} {'x 200 tok':>9} {'tok share':>9}")
    for r in res["decisions"]:
        line = (
            f"{r['prompt_tokens']:>7} {r['body_bytes']:>8} {r['class']:>6} {r['parse_orjson_us']:>8.1f} {r['parse_json_us']:>8.1f} "
            f"{r['tokenize_inline_us']:>10.1f} {r['tokenize_async_us']:>10.1f} {r['size_gateway_us']:>9.1f} "
            + " ".join(f"{r[f'rank_{p}_us']:>17.1f}" for p in pols)
        )
        print(
            line
            + f" {r['decision_us']:>9.1f} {_fmt(r['decision_x_200'], '.1f'):>9} {_fmt(r['tokenize_share'], '.0%'):>9}"
        )
    lag = res["loop_lag"]
    print(
        f"\n== event-loop lag: 1 ms ticker while {lag['prompts']} prompts of {lag['prompt_tokens']:,} tokens are counted, {lag['concurrency']} at a time =="
    )
    print(
        f"{'mode':>9} {'elapsed s':>9} {'prompts/s':>9} {'mean ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 x idle':>10}"
    )
    for k in ("idle", "inline", "off_loop"):
        d = lag[k]
        print(
            f"{k:>9} {d['elapsed_s']:>9.2f} {_fmt(d.get('prompts_per_s')):>9} {_fmt(d['lag_mean_ms'], '.3f'):>8} "
            f"{_fmt(d['lag_p99_ms'], '.3f'):>8} {_fmt(d['lag_max_ms'], '.3f'):>8} {_fmt(d.get('lag_p99_x_idle')):>10}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.routing",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="seconds of timing per measured function (default 0.5)",
    )
    p.add_argument(
        "--lag-prompts",
        type=int,
        default=40,
        help="30k-token prompts counted during the lag test (default 40)",
    )
    p.add_argument("--lag-concurrency", type=int, default=4)
    p.add_argument(
        "--json", dest="json_out", default=None, help="write the results as JSON to this file"
    )
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    cold = cold_tokenizer_load_ms()
    res: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "python": sys.version.split()[0],
        },
        "cold_tokenizer_load_ms": cold,
        "thread_above_chars": DEFAULT_THREAD_CHARS,
        "thread_hop_us": atime_us(lambda: asyncio.to_thread(int), args.min_time),
        "decisions": decision_costs(args.min_time),
        "loop_lag": loop_lag(args.lag_prompts, args.lag_concurrency),
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
