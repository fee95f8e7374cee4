"""Present simulation results: a rich table for people, a JSON document for machines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.sim.model import SimConfig, SimResult
from loadtest.sim.replicas import ReplicaSearch
from loadtest.sim.runner import WorkloadSpec
from loadtest.sim.workload import HoldModel
from proxy.routing.policy import PolicySettings

COLUMNS = {
    "requests": "requests offered",
    "failed": "requests that failed for good: every attempt (and any client retry) found no room",
    "fail %": "failed / requests",
    "failed attempts": "node attempts the allocator rejected (wasted work: a request may make several)",
    "fail >25% free": "failed while the fleet was more than 25% free: false capacity exhaustion",
    "long fail %": "failure rate of long requests",
    "queued": "requests that waited in the gateway's admission queue (queue.max_wait_s) for room",
    "frag": "mean fragmentation ratio, 1 - largest free block / total free, over nodes and time",
    "util": "mean KV utilisation (used / capacity) over nodes and time",
    "restarts": "node restarts (drained, then down for the downtime)",
    "replicas": "smallest fleet keeping failures under the target at this arrival rate",
}


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def table(
    results: Mapping[str, SimResult],
    replicas: Mapping[str, ReplicaSearch] | None = None,
    target: float = 0.001,
) -> Table:
    t = Table(title="kvroute simulate", title_justify="left")
    t.add_column("policy", style="bold")
    for c in COLUMNS:
        if c == "replicas" and not replicas:
            continue
        t.add_column(c if c != "replicas" else f"replicas @{100 * target:g}%", justify="right")
    for name, r in results.items():
        row = [
            name,
            f"{r.requests:,}",
            f"{r.failures:,}",
            _pct(r.failure_rate),
            f"{r.failed_attempts:,}",
            f"{r.false_capacity_failures:,}",
            _pct(r.long_failure_rate),
            f"{r.queued:,}",
            f"{r.mean_fragmentation:.3f}",
            f"{r.utilisation:.3f}",
            str(r.restarts),
        ]
        if replicas:
            s = replicas.get(name)
            row.append(
                "-" if s is None else (str(s.needed) if s.needed is not None else f">{s.max_nodes}")
            )
        t.add_row(*row)
    return t


def headline(results: Mapping[str, SimResult]) -> list[str]:
    """One-line comparisons: kvroute against each baseline and against the oracle."""
    kv = results.get("kvroute")
    if kv is None:
        return []
    out: list[str] = []
    for name, r in results.items():
        if name in ("kvroute", "oracle") or r.failures == 0:
            continue
        cut = 1.0 - kv.failures / r.failures
        out.append(
            f"kvroute vs {name}: {100 * cut:.1f}% fewer failed requests ({kv.failures:,} vs {r.failures:,})"
        )
    o = results.get("oracle")
    if o is not None:
        gap = kv.failure_rate - o.failure_rate
        out.append(
            f"kvroute vs oracle (perfect compaction): failure rate {_pct(kv.failure_rate)} vs {_pct(o.failure_rate)} (+{100 * gap:.3f} points)"
        )
    return out


def print_report(
    results: Mapping[str, SimResult],
    replicas: Mapping[str, ReplicaSearch] | None = None,
    target: float = 0.001,
    console: Console | None = None,
    legend: bool = False,
) -> None:
    con = console or Console()
    con.print(table(results, replicas, target))
    for line in headline(results):
        con.print(line)
    if replicas:
        for name, s in replicas.items():
            probes = ", ".join(f"N={n}: {_pct(v)}" for n, v in sorted(s.probes.items()))
            con.print(f"[dim]replicas {name}: {probes}[/dim]")
    if legend:
        for c, text in COLUMNS.items():
            con.print(f"[dim]{c}: {text}[/dim]")


def document(
    cfg: SimConfig,
    workload: WorkloadSpec,
    duration_s: float,
    results: Mapping[str, SimResult],
    replicas: Mapping[str, ReplicaSearch] | None = None,
    target: float = 0.001,
    series: bool = False,
) -> dict[str, Any]:
    """The JSON form: config, workload, one summary per policy, replicas, optional series."""
    conf = asdict(cfg)
    return {
        "config": conf,
        "workload": workload.describe(),
        "duration_s": duration_s,
        "results": {name: r.to_dict(series=series) for name, r in results.items()},
        "headline": headline(results),
        "replicas": {
            name: {
                "needed": s.needed,
                "max_nodes": s.max_nodes,
                "target": target,
                "probes": {str(n): v for n, v in sorted(s.probes.items())},
            }
            for name, s in (replicas or {}).items()
        },
    }


def from_document(doc: Mapping[str, Any]) -> tuple[dict[str, SimResult], dict[str, ReplicaSearch]]:
    """Results and replicas back from the JSON form (for re-plotting a saved run)."""
    c = dict(doc["config"])
    cfg = SimConfig(
        **{**c, "settings": PolicySettings(**c["settings"]), "hold": HoldModel(**c["hold"])}
    )
    results: dict[str, SimResult] = {}
    for name, d in doc["results"].items():
        r = SimResult(policy=name, config=cfg, duration_s=float(d["duration_s"]))
        for key in (
            "requests",
            "failures",
            "failed_attempts",
            "false_capacity_failures",
            "long_requests",
            "long_failures",
            "restarts",
            "queued",
        ):
            setattr(r, key, int(d.get(key, 0)))
        r.samples = 1
        r.frag_sum = float(d.get("mean_fragmentation", 0.0))
        r.util_sum = float(d.get("utilisation", 0.0))
        ser = d.get("series")
        if ser:
            r.series_t = list(ser["t"])
            r.series_frag = dict(ser["fragmentation"])
            r.series_free = dict(ser["free_tokens"])
            r.series_largest = dict(ser["largest_free_block_tokens"])
            r.series_uptime = dict(ser["uptime_s"])
            r.series_failures = list(ser["failures"])
            r.series_requests = list(ser["requests"])
        results[name] = r
    reps: dict[str, ReplicaSearch] = {}
    for name, d in doc.get("replicas", {}).items():
        s = ReplicaSearch(name, lo=0, hi=d["needed"], max_nodes=int(d["max_nodes"]), done=True)
        s.probes = {int(n): float(v) for n, v in d["probes"].items()}
        reps[name] = s
    return results, reps


def write_json(path: str | Path, doc: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
