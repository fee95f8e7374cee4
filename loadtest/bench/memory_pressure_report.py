"""The memory-pressure benchmark's report: tables, the five targets, preemptions over time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtest.bench.memory_pressure import Outcome


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row: goodput with its ceiling, the TTFT of the request that sets the
    ceiling, and the token-weighted mean end (loadtest.bench.goodput); preemptions with the
    held requests kvroute handed to a backend's queue."""
    head = (
        "| workload | run | policy | failed | preemptions (handed to a queue) "
        "| goodput tok/s (ceiling) "
        "| last request's TTFT (s) | token-weighted end (s) "
        "| short TTFT p99 (s) | long TTFT p99 (s) |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['workload']} | {r['run']} | {r['policy']} | {r['failed']}/{r['requests']} "
        f"| {r['preemptions']} ({r.get('handed_to_queue', 0)}) "
        f"| {r['goodput_tokens_per_s']:.0f} ({r['goodput_ceiling']:.0f}) "
        f"| {fmt(r['last_ttft_s'])} | {fmt(r['mean_end_s'])} "
        f"| {fmt(r['short_ttft_p99'])} | {fmt(r['long_ttft_p99'])} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The five targets (0 failed, preemptions, goodput, short and long TTFT p99), per workload
    and run, then the token-weighted mean end against the best peer's (not one of the five)."""
    out = []
    keys = sorted({(r["workload"], r["run"]) for r in rows})
    for wl, run in keys:
        mine = [r for r in rows if (r["workload"], r["run"]) == (wl, run)]
        kv = next((r for r in mine if r["policy"] == "kvroute"), None)
        peers = [r for r in mine if r["policy"] != "kvroute"]
        if kv is None or not peers:
            continue
        best_pre = min(r["preemptions"] for r in peers)
        best_good = max(r["goodput_tokens_per_s"] for r in peers)
        best_end = min((r["mean_end_s"] or 1e9) for r in peers)
        short = min((r["short_ttft_p99"] or 1e9) for r in peers)
        long_ = min((r["long_ttft_p99"] or 1e9) for r in peers)
        checks = {
            "0 failed": kv["failed"] == 0,
            "preemptions <= 20% best peer": kv["preemptions"] <= 0.2 * best_pre,
            "goodput >= best peer": kv["goodput_tokens_per_s"] >= best_good,
            "short p99 lowest": (kv["short_ttft_p99"] or 1e9) <= short,
            "long p99 <= 1.2x best": (kv["long_ttft_p99"] or 1e9) <= 1.2 * long_,
            "token-weighted end lowest": (kv["mean_end_s"] or 1e9) <= best_end,
        }
        verdict = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items())
        out.append(f"{wl} run {run}: {verdict}")
    return out


def plot(outcomes: list[tuple[str, int, Outcome]], path: Path) -> None:
    """One panel per workload: the fleet's preemption counter over time, each router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(wl for wl, _, _ in outcomes))
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 3.2 * len(names)), squeeze=False)
    for ax, wl in zip(axes[:, 0], names, strict=True):
        first_run = min(run for w, run, _ in outcomes if w == wl)
        for w, run, o in outcomes:
            if w == wl and run == first_run and o.timeline:
                xs, ys = zip(*o.timeline, strict=True)
                ax.plot(xs, ys, label=o.policy, lw=2 if o.policy == "kvroute" else 1)
        ax.set_title(f"{wl} (run {first_run}): preemptions so far, whole fleet")
        ax.set_xlabel("seconds since the first arrival")
        ax.set_ylabel("preemptions")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
