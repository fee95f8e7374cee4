"""PNG plots of simulation results (matplotlib, Agg backend: no display needed).

Four figures: fragmentation ratio against node uptime, largest free block against total
free over time, failures over time, and replicas needed per policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.sim.model import SimResult
from loadtest.sim.replicas import ReplicaSearch

PLOTS_HINT = (
    "plots need matplotlib and Pillow: pip install 'kvroute[sim]' "
    "(in a clone: pip install -e '.[sim]')"
)
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure
except ModuleNotFoundError as exc:  # the gateway image installs no plotting stack
    raise ModuleNotFoundError(PLOTS_HINT, name=exc.name) from None

DPI = 80
MAX_POINTS = 300  # per line: enough for the eye, and keeps each PNG well under 150 KB
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


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    step = max(1, -(-len(xs) // MAX_POINTS))
    return list(xs[::step]), list(ys[::step])


def _window(r: SimResult, seconds: float) -> int:
    return max(1, round(seconds / max(1.0, r.config.series_s)))


def _save(fig: Figure, path: Path) -> Path:
    """PNG with a 256-colour palette: a third of the size, no visible difference for line plots."""
    import io

    from PIL import Image

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
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
            colour = "#2166ac" if p == "kvroute" and node in _long_nodes(r) else "#c51b7d"
            for up, fr in _lives(r.series_uptime[node], frag):
                ax.plot(
                    *_thin([u / 86_400 for u in up], _smooth(fr, w)),
                    lw=0.8,
                    alpha=0.8,
                    color=colour,
                )
        ax.set_title(f"{p}: per node (3 h mean)")
        ax.set_xlabel("node uptime since (re)start, days")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fragmentation ratio\n1 - largest free / total free")
    return _save(fig, path)


def _lives(
    uptime: Sequence[float], values: Sequence[float]
) -> list[tuple[list[float], list[float]]]:
    """Split one node's samples at each restart (uptime falls back), dropping samples while down."""
    out: list[tuple[list[float], list[float]]] = []
    prev = -1.0
    for u, v in zip(uptime, values, strict=True):
        if u <= 0.0:
            prev = -1.0
            continue
        if u < prev or not out or prev < 0:
            out.append(([], []))
        out[-1][0].append(u)
        out[-1][1].append(v)
        prev = u
    return out


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
        ax.plot(*_thin(t, free), color=c, lw=1.2, ls="--", label=f"{p}: total free")
        ax.plot(*_thin(t, largest), color=c, lw=1.6, label=f"{p}: largest free block")
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
        ax.plot(
            *_thin([x / 86_400 for x in r.series_t], rate), color=COLOURS.get(p), lw=1.4, label=p
        )
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.sim.plots RUN.json DIR``: plot a run saved with ``--json-series``."""
    import argparse
    import json
    import sys

    from loadtest.sim.report import from_document

    ap = argparse.ArgumentParser(prog="python -m loadtest.sim.plots", description=main.__doc__)
    ap.add_argument("json", help="a file written by kvroute simulate --json FILE --json-series")
    ap.add_argument("out_dir")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    doc = json.loads(Path(a.json).read_text(encoding="utf-8"))
    results, reps = from_document(doc)
    if not all(r.series_t for r in results.values()):
        print(f"{a.json}: no time series in it (run with --json-series)", file=sys.stderr)
        return 2
    target = next((float(d["target"]) for d in doc.get("replicas", {}).values()), 0.001)
    for p in write_plots(results, a.out_dir, reps or None, target):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
