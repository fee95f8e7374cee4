"""The memory-pressure benchmark's report: tables, the five targets, preemptions over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class Timeline(Protocol):
    """What the plot reads of a run (``memory_pressure.Outcome``, whose module imports this)."""

    @property
    def policy(self) -> str: ...

    @property
    def timeline(self) -> Sequence[tuple[float, int]]: ...


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


def _mean(xs: list[float | None]) -> float:
    """The mean, a missing figure counting as very late (it must not look good)."""
    return sum(1e9 if x is None else x for x in xs) / len(xs) if xs else 1e9


def targets_over_runs(rows: list[dict[str, Any]]) -> list[str]:
    """The five targets per workload, over all its runs: failures summed, goodput and the
    TTFT p99s averaged per router, and the preemption target still checked run by run.

    Why both views: one run's goodput ends with its last answer, so a single late request
    moves it by a few percent either way; the runs together say which router delivers more.
    Only workloads where kvroute and every peer have a row in every run are judged.
    """
    out = []
    for wl in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == wl]
        runs = sorted({r["run"] for r in mine})
        by: dict[str, list[dict[str, Any]]] = {}
        for r in mine:
            by.setdefault(r["policy"], []).append(r)
        if "kvroute" not in by or len(by) < 2 or any(len(v) != len(runs) for v in by.values()):
            continue
        kv = by.pop("kvroute")
        kv_good = _mean([r["goodput_tokens_per_s"] for r in kv])
        best_good = max(_mean([r["goodput_tokens_per_s"] for r in v]) for v in by.values())
        short = min(_mean([r["short_ttft_p99"] for r in v]) for v in by.values())
        long_ = min(_mean([r["long_ttft_p99"] for r in v]) for v in by.values())
        best_pre = {
            run: min(r["preemptions"] for v in by.values() for r in v if r["run"] == run)
            for run in runs
        }
        pre_ok = all(k["preemptions"] <= 0.2 * best_pre[k["run"]] for k in kv)
        checks = {
            "0 failed": sum(r["failed"] for r in kv) == 0,
            "preemptions <= 20% best peer in every run": pre_ok,
            f"goodput >= best peer ({kv_good:.1f} vs {best_good:.1f} tok/s)": kv_good >= best_good,
            "short p99 lowest (mean)": _mean([r["short_ttft_p99"] for r in kv]) <= short,
            "long p99 <= 1.2x best (mean)": _mean([r["long_ttft_p99"] for r in kv]) <= 1.2 * long_,
        }
        verdict = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items())
        out.append(f"{wl}, runs {runs[0]}-{runs[-1]} together: {verdict}")
    return out


def report(rows: list[dict[str, Any]]) -> str:
    """The table, then the verdicts run by run, then each workload's runs together."""
    return "\n".join([table(rows), *targets(rows), *targets_over_runs(rows)])


def plot(outcomes: Sequence[tuple[str, int, Timeline]], path: Path) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Judge saved runs again, together: ``--json`` files of one or more sessions."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.memory_pressure_report", description=main.__doc__
    )
    p.add_argument("json", nargs="+", type=Path, help="rows written by --json")
    args = p.parse_args(argv)
    print(report([r for path in args.json for r in json.loads(path.read_text())]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
