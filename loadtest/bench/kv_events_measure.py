"""What the KV-events benchmark measures: drive a workload, read hit rates and TTFT, tabulate.

Split from ``loadtest.bench.kv_events`` (which starts fleets and routers per row): the open
loop that sends the workload, the hit rate of routed requests from each answer's usage
(``prompt_tokens_details.cached_tokens``), the engines' counters before and after, the row.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.bench.prefix import pct
from loadtest.engine.behaviours.prefix_cache import prompt_block_hashes, prompt_ids
from loadtest.workload import SharedDocs

BYPASS_SHARE = 0.3


@dataclass
class Row:
    scenario: str
    target: str
    run: int = 1
    hit_rate: float = 0.0
    # The same from the answers' usage (prompt_tokens_details.cached_tokens): routed only.
    routed_hit_rate: float = 0.0
    doc_p50_ms: float = 0.0
    doc_p99_ms: float = 0.0
    failed: int = 0
    requests: int = 0
    note: str = ""
    # The most any router could reach on this request list (``ceiling``): all, routed.
    ceiling: float = 0.0
    routed_ceiling: float = 0.0


async def drive(
    urls: list[str], w: SharedDocs, payloads: list[dict[str, Any]], restart: Any
) -> list[dict[str, Any]]:
    """Open loop; request i goes to ``urls[i]``; ``restart`` (or None) runs half way through."""
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    half = w.turns[len(w.turns) // 2].arrival_s if w.turns else 0.0
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        start = time.monotonic()

        async def one(i: int, kind: str, body: dict[str, Any], url: str, routed: bool) -> None:
            t0 = time.monotonic()
            res: dict[str, Any] = {"i": i, "kind": kind, "status": 0, "ttft": None}
            res["routed"] = routed
            tail = b""
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    res["status"] = r.status_code
                    async for piece in r.aiter_bytes():
                        if res["ttft"] is None:
                            res["ttft"] = time.monotonic() - t0
                        tail = (tail + piece)[-4096:]
            except httpx.HTTPError:
                res["status"] = -1
            res["prompt"], res["cached"] = usage_of(tail)
            results.append(res)

        tasks: list[asyncio.Task[None]] = []
        restarted: asyncio.Task[None] | None = None
        for i, (t, body) in enumerate(zip(w.turns, payloads, strict=True)):
            delay = start + t.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if restart is not None and restarted is None and t.arrival_s >= half:
                restarted = asyncio.create_task(asyncio.to_thread(restart))
            routed = not urls[i].startswith("direct:")
            url = urls[i].removeprefix("direct:")
            tasks.append(asyncio.create_task(one(i, t.kind, body, url, routed)))
        await asyncio.gather(*tasks)
        if restarted is not None:
            await restarted
    return results


_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')


def usage_of(tail: bytes) -> tuple[int, int]:
    """(prompt tokens, of them cached) from a stream's final usage chunk; (0, 0) without one."""
    prompt, cached = _PROMPT.findall(tail), _CACHED.findall(tail)
    if not prompt or not cached:
        return 0, 0
    return int(prompt[-1]), int(cached[-1])


def request_urls(
    scenario: str, routers: list[str], engines: list[str], n: int, seed: int
) -> list[str]:
    rng = random.Random(seed + 7)
    out = []
    for i in range(n):
        if scenario == "bypass" and rng.random() < BYPASS_SHARE:
            out.append("direct:" + rng.choice(engines))
        else:
            out.append(routers[i % len(routers)])
    return out


def fill(
    row: Row,
    results: list[dict[str, Any]],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    scenario: str,
) -> None:
    def delta(name: str) -> float:
        got = 0.0
        for b, a in zip(before, after, strict=True):
            # A restarted engine's counters start again from 0: count what it did since.
            got += a.get(name, 0.0) - (
                b.get(name, 0.0) if a.get(name, 0.0) >= b.get(name, 0.0) else 0.0
            )
        return got

    queries = delta("vllm:prefix_cache_queries_total")
    row.hit_rate = delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0
    routed = [r for r in results if r["routed"]]
    ok = [r for r in routed if r["status"] == 200 and r["ttft"] is not None]
    docs = [r["ttft"] for r in ok if r["kind"] == "document"]
    row.doc_p50_ms = 1000 * statistics.median(docs) if docs else 0.0
    row.doc_p99_ms = 1000 * pct(docs, 0.99)
    prompted = sum(r["prompt"] for r in ok)
    row.routed_hit_rate = sum(r["cached"] for r in ok) / prompted if prompted else 0.0
    row.requests = len(routed)
    row.failed = len(routed) - len(ok)
    if scenario == "restart":
        row.note = "restart counters: hit rate from the engines' counters since start"
    if row.failed:
        # What the failures were: the status (-1: the connection broke) and kind.
        bad = sorted(f"{r['status']} {r['kind']}" for r in routed if r not in ok)
        row.note = (row.note + "; " if row.note else "") + "failed: " + ", ".join(bad)


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The highest hit rate any router can reach on a request list, all and routed requests."""

    all: float
    routed: float


def ceiling(payloads: Sequence[dict[str, Any]], routed: Sequence[bool], block_size: int) -> Ceiling:
    """What the engines could have found cached had every block sent before stayed cached.

    A block can be a hit only if an earlier request's prompt held it (the engine's own
    chained block hashes, ``loadtest.engine.behaviours.prefix_cache``), and, as in vLLM, the
    last prompt token is always computed. Every eviction, restart and placement is ignored,
    so no router and no index, exact or not, reaches more: a target above it cannot be met on
    this list.
    """
    seen: set[int] = set()
    hits = [0, 0]
    tokens = [0, 0]
    for body, via_router in zip(payloads, routed, strict=True):
        hashes = prompt_block_hashes(body, block_size)
        n = len(prompt_ids(body))
        run = 0
        for h in hashes:
            if h not in seen:
                break
            run += 1
        found = max(0, min(run * block_size, n - 1))
        for i in (0, 1) if via_router else (0,):
            hits[i] += found
            tokens[i] += n
        seen.update(hashes)
    return Ceiling(
        hits[0] / tokens[0] if tokens[0] else 0.0, hits[1] / tokens[1] if tokens[1] else 0.0
    )


#: The issue's target for events over the approximate index, under restart and bypass.
TARGET_RATIO = 1.25


def ratios(rows: Sequence[Row]) -> str:
    """Events ÷ approximate per scenario and run, and whether 1.25x fits under the ceiling.

    "needs" is ``TARGET_RATIO`` times the approximate row's hit rate: where it is above the
    scenario's ceiling (marked ``> ceiling``), no index could reach the ratio on that run.
    """
    head = (
        "| scenario | run | events ÷ approximate | routed | 1.25x needs | routed: needs "
        "| ceiling | routed: ceiling |\n|---|---|---|---|---|---|---|---|"
    )
    by = {(r.scenario, r.run, r.target): r for r in rows}
    lines = []
    for (scenario, run, target), ev in by.items():
        ap = by.get((scenario, run, "kvroute approximate"))
        if target != "kvroute + events" or ap is None or not ap.hit_rate or not ap.routed_hit_rate:
            continue
        need, need_routed = TARGET_RATIO * ap.hit_rate, TARGET_RATIO * ap.routed_hit_rate

        def mark(v: float, top: float) -> str:
            return f"{v:.1%}" + (" > ceiling" if v > top else "")

        lines.append(
            f"| {scenario} | {run} | {ev.hit_rate / ap.hit_rate:.2f}x | "
            f"{ev.routed_hit_rate / ap.routed_hit_rate:.2f}x | {mark(need, ev.ceiling)} | "
            f"{mark(need_routed, ev.routed_ceiling)} | {ev.ceiling:.1%} | "
            f"{ev.routed_ceiling:.1%} |"
        )
    return "\n".join([head, *lines])


def table(rows: Sequence[Row]) -> str:
    head = (
        "| run | scenario | target | hit rate (ceiling) | routed hit rate (ceiling) "
        "| doc TTFT p50 ms | doc TTFT p99 ms | failed |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.run} | {r.scenario} | {r.target} | {r.hit_rate:.1%} ({r.ceiling:.1%}) | "
        f"{r.routed_hit_rate:.1%} ({r.routed_ceiling:.1%}) | "
        f"{r.doc_p50_ms:.0f} | {r.doc_p99_ms:.0f} | "
        f"{r.failed}/{r.requests} |"
        # A skipped row's reason, or what the failures were (status and kind).
        + (f" {r.note}" if r.note and (r.failed or not r.requests) else "")
        for r in rows
    ]
    return "\n".join([head, *lines])
