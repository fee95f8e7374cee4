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
from loadtest.workload import SharedDocs

BYPASS_SHARE = 0.3


@dataclass
class Row:
    scenario: str
    target: str
    hit_rate: float = 0.0
    # The same from the answers' usage (prompt_tokens_details.cached_tokens): routed only.
    routed_hit_rate: float = 0.0
    doc_p50_ms: float = 0.0
    doc_p99_ms: float = 0.0
    failed: int = 0
    requests: int = 0
    note: str = ""


async def drive(
    urls: list[str], w: SharedDocs, payloads: list[dict[str, Any]], restart: Any
) -> list[dict[str, Any]]:
    """Open loop; request i goes to ``urls[i]``; ``restart`` (or None) runs half way through."""
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    half = w.turns[len(w.turns) // 2].arrival_s if w.turns else 0.0
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        start = time.monotonic()

        async def one(kind: str, body: dict[str, Any], url: str, routed: bool) -> None:
            t0 = time.monotonic()
            res: dict[str, Any] = {"kind": kind, "status": 0, "ttft": None, "routed": routed}
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
            tasks.append(asyncio.create_task(one(t.kind, body, url, routed)))
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
    if row.failed:
        # What the failures were: the status (-1: the connection broke) and kind.
        bad = sorted(f"{r['status']} {r['kind']}" for r in routed if r not in ok)
        row.note = (row.note + "; " if row.note else "") + "failed: " + ", ".join(bad)
    if scenario == "restart":
        row.note = "restart counters: hit rate from the engines' counters since start"


def table(rows: Sequence[Row]) -> str:
    head = (
        "| scenario | target | hit rate | routed hit rate | doc TTFT p50 ms | doc TTFT p99 ms "
        "| failed |\n|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.scenario} | {r.target} | {r.hit_rate:.1%} | {r.routed_hit_rate:.1%} | "
        f"{r.doc_p50_ms:.0f} | {r.doc_p99_ms:.0f} | "
        f"{r.failed}/{r.requests} |"
        # A skipped row's reason, or what the failures were (status and kind).
        + (f" {r.note}" if r.note and (r.failed or not r.requests) else "")
        for r in rows
    ]
    return "\n".join([head, *lines])
