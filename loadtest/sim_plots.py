"""PNG plots of simulation results (matplotlib, Agg backend: no display needed).

Four figures: fragmentation ratio against node uptime, largest free block against total
free over time, failures over time, and replicas needed per policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from loadtest.sim_engine import SimResult
from loadtest.sim_replicas import ReplicaSearch

DPI = 90
COLOURS = {
    "kvroute": "#1b7837",
    "round_robin": "#c51b7d",
    "least_loaded": "#e08214",
    "most_free": "#2166ac",
    "oracle": "#555555",
}


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the raw samples are noisy at the scale of one request)."""
    out: list[float] = []
    acc = 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _window(r: SimResult, seconds: float) -> int:
    return max(1, round(seconds / max(1.0, r.config.series_s)))


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def fragmentation_vs_uptime(
    results: Mapping[str, SimResult],
    path: Path,
    policies: Sequence[str] = ("round_robin", "kvroute"),
) -> Path:
    shown = [p for p in policies if p in results] or list(results)[:2]
    fig, axes = plt.subplots(
        1, len(shown), figsize=(5.2 * len(shown), 3.6), sharey=True, squeeze=False
    )
    for ax, p in zip(axes[0], shown, strict=True):
        r = results[p]
        w = _window(r, 3 * 3600)
        for node, frag in r.series_frag.items():
            up = r.series_uptime[node]
            role = "long pool" if p == "kvroute" and node in _long_nodes(r) else "general"
            ax.plot(
                [u / 86_400 for u in up],
                _smooth(frag, w),
                lw=0.8,
                alpha=0.8,
                color="#2166ac" if role == "long pool" else "#c51b7d",
            )
        ax.set_title(f"{p}: per node (3 h mean)")
        ax.set_xlabel("node uptime since (re)start, days")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fragmentation ratio\n1 - largest free / total free")
    return _save(fig, path)


def _long_nodes(r: SimResult) -> set[str]:
    names = r.config.node_names()
    return set(names[len(names) - r.config.long_pool :]) if r.config.long_pool else set()


def largest_vs_free(results: Mapping[str, SimResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for p, r in results.items():
        if p == "oracle":
            continue
        t = [x / 86_400 for x in r.series_t]
        n = len(r.series_free)
        w = _window(r, 3 * 3600)
        free = _smooth([sum(v[i] for v in r.series_free.values()) / n for i in range(len(t))], w)
        largest = _smooth(
            [sum(v[i] for v in r.series_largest.values()) / n for i in range(len(t))], w
        )
        c = COLOURS.get(p, None)
        ax.plot(t, free, color=c, lw=1.2, ls="--", label=f"{p}: total free")
        ax.plot(t, largest, color=c, lw=1.6, label=f"{p}: largest free block")
    ax.set_xlabel("simulated time, days")
    ax.set_ylabel("tokens per node (mean, 3 h)")
    ax.set_title("largest contiguous free block vs total free")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def failures_over_time(results: Mapping[str, SimResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for p, r in results.items():
        w = _window(r, 6 * 3600)
        fails = _smooth([float(x) for x in r.series_failures], w)
        reqs = _smooth([float(x) for x in r.series_requests], w)
        rate = [100 * f / q if q else 0.0 for f, q in zip(fails, reqs, strict=True)]
        ax.plot([x / 86_400 for x in r.series_t], rate, color=COLOURS.get(p), lw=1.4, label=p)
    ax.set_xlabel("simulated time, days")
    ax.set_ylabel("failed requests, % (6 h mean)")
    ax.set_title("allocation failures over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def replicas_bar(
    replicas: Mapping[str, ReplicaSearch],
    path: Path,
    target: float,
    baseline_nodes: int | None = None,
) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = list(replicas)
    vals = [replicas[p].needed or replicas[p].max_nodes + 1 for p in names]
    bars = ax.bar(names, vals, color=[COLOURS.get(p, "#777777") for p in names])
    for b, p in zip(bars, names, strict=True):
        label = (
            str(replicas[p].needed)
            if replicas[p].needed is not None
            else f">{replicas[p].max_nodes}"
        )
        ax.annotate(
            label,
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    if baseline_nodes:
        ax.axhline(baseline_nodes, color="#999999", lw=0.8, ls=":")
    ax.set_ylabel("nodes")
    ax.set_title(f"replicas needed for < {100 * target:g}% failed requests")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(0, max(vals) * 1.18)
    return _save(fig, path)


def write_plots(
    results: Mapping[str, SimResult],
    out_dir: str | Path,
    replicas: Mapping[str, ReplicaSearch] | None = None,
    target: float = 0.001,
) -> list[Path]:
    """All plots into ``out_dir``; returns the files written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [
        fragmentation_vs_uptime(results, d / "sim_fragmentation_vs_uptime.png"),
        largest_vs_free(results, d / "sim_largest_vs_free.png"),
        failures_over_time(results, d / "sim_failures_over_time.png"),
    ]
    if replicas:
        nodes = next(iter(results.values())).config.nodes if results else None
        paths.append(replicas_bar(replicas, d / "sim_replicas_needed.png", target, nodes))
    return paths
