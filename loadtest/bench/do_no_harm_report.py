"""The do-no-harm verdicts: medians over runs, the issue's targets, the printed tables.

Issue 53's targets, per cell and engine model, against vllm-router's ``power_of_two`` (the
blind policy kvroute lost to) and the best peer:

* kvroute fails nothing;
* its short-request TTFT p50 and p99 are at most 1.05x power_of_two's (medians over runs),
  and in no single run worse than 1.5x (a median can hide one bad run);
* where memory binds, its preemptions are at most the best peer's;
* at overload, its TTFT p99 (all requests) is at most 1.2x the best peer's, and no request
  waits in its hold longer than the best peer's TTFT p99 (in any run: the longest
  ``Server-Timing: hold`` of kvroute's answers against that run's best peer).

A target that cannot be checked (no power_of_two row: vllm-router missing) reads ``n/a``,
and the cell's verdict is ``INCOMPLETE`` rather than a pass. Pure but for printing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench.do_no_harm_cells import Cell

FIGURES = (
    "failed",
    "requests",
    "short_ttft_p50",
    "short_ttft_p99",
    "long_ttft_p50",
    "long_ttft_p99",
    "ttft_p99",
    "preemptions",
    "goodput",
    "queue_wait_count",
    "queue_wait_s",
    "queued_at_backend",
    "longest_hold_s",
)
BASELINE = "power_of_two"


def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (engine model, cell): each router's medians over its runs, and the runs."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        entry = cells.setdefault((r["model"], r["cell"]), {"routers": {}})
        entry |= {"model": r["model"], "cell": r["cell"]}
        entry["routers"].setdefault(r["router"], {"runs": []})["runs"].append(dict(r))
    for entry in cells.values():
        for router in entry["routers"].values():
            runs = router["runs"]
            router["median"] = {k: median([x.get(k) for x in runs]) for k in FIGURES}
            router["max_failed"] = max(x["failed"] for x in runs)
    return list(cells.values())


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return a / b if b > 0 else (1.0 if a <= 0 else float("inf"))


def _check(name: str, value: float | None, limit: float) -> dict[str, Any]:
    ok = None if value is None else value <= limit
    return {"check": name, "value": value, "limit": limit, "ok": ok}


def worst_run_ratio(kv: Mapping[str, Any], base: Mapping[str, Any]) -> float | None:
    """The largest short-TTFT ratio (p50 or p99) of any one run, runs paired by number."""
    by_run = {r["run"]: r for r in base["runs"]}
    worst: float | None = None
    for run in kv["runs"]:
        other = by_run.get(run["run"])
        for key in ("short_ttft_p50", "short_ttft_p99"):
            x = ratio(run.get(key), other.get(key)) if other is not None else None
            if x is not None:
                worst = x if worst is None else max(worst, x)
    return worst


def cell_checks(entry: Mapping[str, Any], cell: Cell) -> list[dict[str, Any]]:
    routers = entry["routers"]
    kv = routers.get("kvroute")
    if kv is None:
        return [_check("kvroute ran", None, 0)]
    base = routers.get(BASELINE)
    peers = [r["median"] for name, r in routers.items() if name != "kvroute"]
    med = kv["median"]
    bmed = base["median"] if base is not None else {}
    checks = [_check("kvroute failed", kv["max_failed"], 0)]
    for key in ("short_ttft_p50", "short_ttft_p99"):
        checks.append(_check(f"{key} / {BASELINE}", ratio(med[key], bmed.get(key)), 1.05))
    worst = worst_run_ratio(kv, base) if base is not None else None
    checks.append(_check(f"worst run short TTFT / {BASELINE}", worst, 1.5))
    if cell.memory_bound:
        best = min((p["preemptions"] for p in peers if p["preemptions"] is not None), default=None)
        value = None if best is None else med["preemptions"] - best
        checks.append(_check("preemptions - best peer's", value, 0))
    if cell.overloaded:
        best = min((p["ttft_p99"] for p in peers if p["ttft_p99"] is not None), default=None)
        checks.append(_check("TTFT p99 / best peer's", ratio(med["ttft_p99"], best), 1.2))
        checks.append(_check("longest hold / best peer's TTFT p99", longest_hold(entry), 1.0))
    return checks


def longest_hold(entry: Mapping[str, Any]) -> float | None:
    """The worst run's longest kvroute hold over that run's best peer TTFT p99 (all requests)."""
    routers = entry["routers"]
    worst: float | None = None
    for run in routers["kvroute"]["runs"]:
        peers = [
            r["ttft_p99"]
            for name, router in routers.items()
            if name != "kvroute"
            for r in router["runs"]
            if r["run"] == run["run"] and r.get("ttft_p99") is not None
        ]
        x = ratio(run.get("longest_hold_s"), min(peers)) if peers else None
        if x is not None:
            worst = x if worst is None else max(worst, x)
    return worst


def verdicts(cells: Sequence[dict[str, Any]], specs: Mapping[str, Cell]) -> list[dict[str, Any]]:
    """Each (model, cell) entry with its checks and ``verdict``: PASS, FAIL or INCOMPLETE."""
    out = []
    for entry in cells:
        checks = cell_checks(entry, specs[entry["cell"]])
        oks = [c["ok"] for c in checks]
        verdict = "FAIL" if False in oks else ("INCOMPLETE" if None in oks else "PASS")
        out.append({**entry, "checks": checks, "verdict": verdict})
    return out


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def figures_table(results: Sequence[Mapping[str, Any]]) -> Table:
    t = Table(title="do no harm: medians over runs (TTFT in wall seconds)")
    heads = ["model", "cell", "router", "failed", "short p50", "short p99", "long p50"]
    heads += [
        "long p99",
        "all p99",
        "preempt",
        "goodput tok/s",
        "kvroute holds: n / s / queued / longest s",
    ]
    for h in heads:
        t.add_column(h)
    for entry in results:
        for name, r in entry["routers"].items():
            m = r["median"]
            holds = ""
            if name == "kvroute":
                holds = f"{_f(m['queue_wait_count'], 0)} / {_f(m['queue_wait_s'], 2)}"
                holds += f" / {_f(m['queued_at_backend'], 0)} / {_f(m['longest_hold_s'], 2)}"
            t.add_row(
                entry["model"], entry["cell"], name, f"{r['max_failed']}/{_f(m['requests'], 0)}",
                _f(m["short_ttft_p50"]), _f(m["short_ttft_p99"]), _f(m["long_ttft_p50"]),
                _f(m["long_ttft_p99"]), _f(m["ttft_p99"]), _f(m["preemptions"], 0),
                _f(m["goodput"], 0), holds,
            )  # fmt: skip
    return t


def verdict_table(results: Sequence[Mapping[str, Any]]) -> Table:
    t = Table(title="do no harm: kvroute against its targets, per cell")
    for h in ("model", "cell", "checks (value <= limit)", "verdict"):
        t.add_column(h)
    for entry in results:
        lines = [
            f"{'ok ' if c['ok'] else ('n/a' if c['ok'] is None else 'BAD')} {c['check']}: "
            f"{_f(c['value'], 2)} <= {c['limit']}"
            for c in entry["checks"]
        ]
        t.add_row(entry["model"], entry["cell"], "\n".join(lines), entry["verdict"])
    return t


def table(results: Sequence[Mapping[str, Any]], console: Console | None = None) -> None:
    console = console or Console(width=160)
    console.print(figures_table(results))
    console.print(verdict_table(results))
