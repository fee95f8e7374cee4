"""Drive a workload through an OpenAI-compatible endpoint and record what happened.

Shared by the demo and the end-to-end comparison script: requests are sent open-loop at
their arrival times (a slow gateway does not slow the offered load down, as in
production), with the problem statement's sizes, and each result keeps the gateway's
routing headers so failures can be told apart by cause.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from loadtest.workload import Request, chat_overhead_tokens, make_prompt


@dataclass(slots=True)
class Result:
    kind: str
    demand: int
    status: int
    latency_s: float
    backend: str = ""
    attempts: int = 0
    error_code: str = ""
    cause: str = ""


@dataclass
class RunStats:
    results: list[Result] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0

    def add(self, r: Result) -> None:
        self.results.append(r)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.results if r.status == 200)

    @property
    def failed(self) -> int:
        return len(self.results) - self.ok

    def failed_of(self, kind: str) -> tuple[int, int]:
        rs = [r for r in self.results if r.kind == kind]
        return sum(1 for r in rs if r.status != 200), len(rs)

    @property
    def extra_attempts(self) -> int:
        """Upstream attempts beyond one per request: each one a backend allocation failure or error."""
        return sum(max(0, r.attempts - 1) for r in self.results)

    def latency_pct(self, q: float) -> float:
        lat = sorted(r.latency_s for r in self.results if r.status == 200)
        if not lat:
            return float("nan")
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    def goodput_tokens_per_s(self) -> float:
        dur = (self.finished or time.monotonic()) - self.started
        return sum(r.demand for r in self.results if r.status == 200) / dur if dur > 0 else 0.0


def request_body(
    req: Request, rng: random.Random, model: str = "sim-model", stream: bool = False
) -> dict[str, object]:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": make_prompt(max(1, req.prompt_tokens - chat_overhead_tokens()), rng),
            }
        ],
        "max_tokens": max(1, req.output_tokens),
        "stream": stream,
    }


async def send_one(
    client: httpx.AsyncClient, url: str, req: Request, body: dict[str, object], stats: RunStats
) -> Result:
    t0 = time.monotonic()
    try:
        resp = await client.post(url, json=body)
        status = resp.status_code
        code = cause = ""
        if status != 200:
            try:
                err = resp.json().get("error", {})
                code = str(err.get("code") or "")
                cause = str(err.get("cause") or "")
            except ValueError:
                code = "not_json"
        h = resp.headers
        res = Result(
            kind=req.kind,
            demand=int(h.get("x-kvroute-demand-tokens", req.total_tokens)),
            status=status,
            latency_s=time.monotonic() - t0,
            backend=h.get("x-kvroute-backend", ""),
            attempts=int(h.get("x-kvroute-attempts", "1") or 1),
            error_code=code,
            cause=cause,
        )
    except httpx.HTTPError as exc:
        res = Result(
            req.kind, req.total_tokens, 0, time.monotonic() - t0, error_code=exc.__class__.__name__
        )
    stats.add(res)
    return res


async def drive(
    base_url: str,
    requests: list[Request],
    *,
    seed: int = 0,
    time_scale: float = 1.0,
    max_inflight: int = 512,
    on_result: Callable[[Result], None] | None = None,
    timeout_s: float = 120.0,
) -> RunStats:
    """Send `requests` open-loop at arrival_s x time_scale; returns when all have answered."""
    rng = random.Random(seed)
    bodies = [
        request_body(r, rng) for r in requests
    ]  # built up front: the clock is for sending only
    stats = RunStats()
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=max_inflight, max_keepalive_connections=max_inflight)
    sem = asyncio.Semaphore(max_inflight)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()
        stats.started = start
        tasks: list[asyncio.Task[None]] = []

        async def one(req: Request, body: dict[str, object]) -> None:
            async with sem:
                res = await send_one(client, url, req, body, stats)
            if on_result is not None:
                on_result(res)

        for req, body in zip(requests, bodies, strict=True):
            delay = start + req.arrival_s * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, body)))
        await asyncio.gather(*tasks)
    stats.finished = time.monotonic()
    return stats
