"""A debug trace for the memory-pressure benchmark: what each engine held when it preempted.

A preemption count says that something went wrong, not why. Every 0.25 s this records, per
engine of every node (data-parallel ones have several), the requests running and waiting,
the KV in use and the preemption counter, and from kvroute's ``GET /fleet`` what the
gateway projected for the node then (budget, tracked flights, projected peak). Written as
JSON lines (``--debug-trace DIR``: one file per workload, run and router); ``rises`` prints
the samples before each rise. It found the causes of the first runs' preemptions: an
engine of a data-parallel node at 94% while the projection split the node evenly, and
documents projected at the chats' learned ratio in a run's first seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
}


def engine_figures(metrics: str) -> dict[str, dict[str, float]]:
    """Per ``engine`` label: running, waiting, KV usage and preemptions from vLLM's metrics."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        name, brace, rest = line.partition("{")
        field = _GAUGES.get(name)
        if field is None or not brace:
            continue
        labels, _, value = rest.rpartition("} ")
        engine = "0"
        for pair in labels.split(","):
            key, _, val = pair.partition("=")
            if key.strip() == "engine":
                engine = val.strip('"')
        out.setdefault(engine, {})[field] = float(value)
    return out


async def _sample(
    client: httpx.AsyncClient, gateway: str, engines: dict[str, str]
) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, url in engines.items():
        try:
            row[name] = {"engines": engine_figures((await client.get(url + "/metrics")).text)}
        except httpx.HTTPError as exc:
            row[name] = {"error": str(exc)}
    try:
        fleet = (await client.get(gateway + "/fleet")).json().get("backends", [])
    except (httpx.HTTPError, ValueError):
        fleet = []
    for b in fleet:
        if isinstance(b, dict) and b.get("name") in row and "memory_pressure" in b:
            row[b["name"]]["projection"] = b["memory_pressure"]
    return row


async def record(
    gateway: str, engines: dict[str, str], t0: float, stop: asyncio.Event, path: Path
) -> None:
    """Append one sample every 0.25 s to ``path`` until ``stop``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(timeout=5) as client:
        with path.open("w") as out:
            while not stop.is_set():
                row = await _sample(client, gateway, engines)
                row["t"] = round(time.monotonic() - t0, 2)
                out.write(json.dumps(row) + "\n")
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except TimeoutError:
                    pass


def rises(path: Path, before: int = 4) -> list[str]:
    """Each preemption rise in a trace file and the ``before`` samples that led to it."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    seen: dict[tuple[str, str], float] = {}
    lines: list[str] = []
    for i, row in enumerate(rows):
        for node, part in row.items():
            if not isinstance(part, dict):
                continue
            for engine, figures in part.get("engines", {}).items():
                count = figures.get("preemptions", 0.0)
                if count > seen.get((node, engine), 0.0):
                    lines.append(f"t={row['t']} {node} engine {engine}: preemptions {count:.0f}")
                    for prev in rows[max(0, i - before) : i + 1]:
                        p = prev.get(node, {})
                        lines.append(f"  t={prev['t']} {p.get('engines')} {p.get('projection')}")
                seen[(node, engine)] = count
    return lines
