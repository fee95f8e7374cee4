"""The overhead benchmark's results: one measured point, rounds merged, ratios to direct,
and the printed table."""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Point:
    target: str
    mode: str  # "json" or "sse"
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    router_cpu_us_per_req: float | None
    backend_cpu_us_per_req: float
    events_per_response: int | None = None
    events_per_s: float | None = None
    rps_ratio_vs_direct: float | None = None
    p50_added_ms: float | None = None
    p99_added_ms: float | None = None
    rounds: int = 1


def merge_rounds(points: list[Point]) -> Point:
    """Median over rounds of the same (target, mode, concurrency)."""
    first = points[0]
    if len(points) == 1:
        return first

    def med(vals: list[float | None]) -> float | None:
        xs = [v for v in vals if v is not None]
        return statistics.median(xs) if xs else None

    return Point(
        target=first.target,
        mode=first.mode,
        concurrency=first.concurrency,
        rps=statistics.median(p.rps for p in points),
        p50_ms=statistics.median(p.p50_ms for p in points),
        p99_ms=statistics.median(p.p99_ms for p in points),
        errors=sum(p.errors for p in points),
        requests=sum(p.requests for p in points),
        router_cpu_us_per_req=med([p.router_cpu_us_per_req for p in points]),
        backend_cpu_us_per_req=statistics.median(p.backend_cpu_us_per_req for p in points),
        rounds=len(points),
    )


def add_ratios(points: list[Point], events: dict[str, int]) -> None:
    direct = {(p.mode, p.concurrency): p for p in points if p.target == "direct"}
    for p in points:
        if p.mode == "sse":
            p.events_per_response = events.get(p.target)
            if p.events_per_response is not None:
                p.events_per_s = p.rps * p.events_per_response
        d = direct.get((p.mode, p.concurrency))
        if d is not None and d.rps > 0:
            p.rps_ratio_vs_direct = p.rps / d.rps
            p.p50_added_ms = p.p50_ms - d.p50_ms
            p.p99_added_ms = p.p99_ms - d.p99_ms


def loadavg() -> list[float]:
    with contextlib.suppress(OSError):
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    return []


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(points: list[Point], skipped: dict[str, str], notes: dict[str, str]) -> None:
    for mode in ("json", "sse"):
        rows = [p for p in points if p.mode == mode]
        if not rows:
            continue
        title = (
            "non-streaming chat completions"
            if mode == "json"
            else "streaming (SSE) chat completions"
        )
        print(f"\n== {title} ==")
        head = f"{'target':<22} {'conc':>4} {'req/s':>8} {'x direct':>8} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} {'+p99 ms':>7} {'router CPU us/req':>17} {'err':>4}"
        if mode == "sse":
            head += f" {'events/s':>9}"
        print(head)
        for p in sorted(rows, key=lambda r: (r.concurrency, r.target != "direct", r.target)):
            line = (
                f"{p.target:<22} {p.concurrency:>4} {p.rps:>8.0f} {_fmt(p.rps_ratio_vs_direct, '.2f'):>8} {p.p50_ms:>7.2f} {p.p99_ms:>7.2f} "
                f"{_fmt(p.p50_added_ms, '+.2f'):>7} {_fmt(p.p99_added_ms, '+.2f'):>7} {_fmt(p.router_cpu_us_per_req, '.0f'):>17} {p.errors:>4}"
            )
            if mode == "sse":
                line += f" {_fmt(p.events_per_s, ',.0f'):>9}"
            print(line)
    print()
    for name, note in notes.items():
        print(f"  {name}: {note}")
    for name, why in skipped.items():
        print(f"  SKIPPED {name}: {why}")


def summary(points: list[Point], extras: dict[str, Any], top_conc: int) -> dict[str, Any]:
    """The issue's figures in one place: ratios to the bare proxy (vllm-router's stand-in
    where it cannot run) and to direct, added latency, SSE rate, round trips, decision, workers."""
    at = {(p.target, p.mode, p.concurrency): p for p in points}
    out: dict[str, Any] = {}
    for mode in ("json", "sse"):
        for conc in sorted({p.concurrency for p in points if p.mode == mode}):
            kv = at.get(("kvroute", mode, conc))
            if kv is None:
                continue
            row: dict[str, Any] = {
                "kvroute_rps": round(kv.rps),
                "x_direct": _round(kv.rps_ratio_vs_direct),
                "p50_added_ms": _round(kv.p50_added_ms),
                "p99_added_ms": _round(kv.p99_added_ms),
                "cpu_us_per_req": _round(kv.router_cpu_us_per_req, 0),
            }
            for ref in ("bare-aiohttp-proxy", "vllm-router"):
                r = at.get((ref, mode, conc))
                if r is not None and r.rps > 0:
                    row[f"x_{ref}"] = round(kv.rps / r.rps, 3)
            if mode == "sse":
                row["events_per_s"] = _round(kv.events_per_s, 0)
                d = at.get(("direct", mode, conc))
                b = at.get(("bare-aiohttp-proxy", mode, conc))
                if b is not None and b.events_per_s and kv.events_per_s:
                    row["events_x_bare-aiohttp-proxy"] = round(kv.events_per_s / b.events_per_s, 3)
                if d is not None and d.events_per_s and kv.events_per_s:
                    row["events_x_direct"] = round(kv.events_per_s / d.events_per_s, 3)
            out[f"{mode} c={conc}"] = row
    w1 = at.get(("kvroute-redis", "json", top_conc))
    w2 = at.get(("kvroute-redis-w2", "json", top_conc))
    if w1 is not None and w2 is not None and w1.rps > 0:
        out["workers"] = {
            "concurrency": top_conc,
            "rps_1": round(w1.rps),
            "rps_2": round(w2.rps),
            "x": round(w2.rps / w1.rps, 3),
        }
    out.update(extras)
    return out


def _round(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)


def print_summary(s: dict[str, Any]) -> None:
    print("\n== summary (kvroute; x_bare-aiohttp-proxy is the stand-in for x vllm-router) ==")
    for key, val in s.items():
        if isinstance(val, dict):
            print(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in val.items()))
        else:
            print(f"  {key}: {val}")
