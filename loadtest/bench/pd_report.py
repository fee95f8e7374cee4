"""The disaggregation benchmark's report: where the slowest first tokens' time went, tables, plot.

kvroute's answers carry ``Server-Timing`` (``proxy.core.two_step``): ``hold`` (arrival to the
decode reservation), ``prefill`` (step 1 itself) and ``decode_sent`` (arrival to step 2 sent;
the later of the first two when the prefill ran during the hold). What the client waited
after ``decode_sent`` is the decode server's (the KV pull, its queue, the first token) plus
the relay. The breakdown averages it over the slowest requests, the ones that set the p99.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench.queueing import Sample

# How many of the slowest first tokens the breakdown averages (the p99 of ~70 is the worst one).
SLOWEST = 3


def server_timing(value: str) -> dict[str, float]:
    """``name;dur=ms, ...`` as {name: seconds}; entries without a duration are left out."""
    out: dict[str, float] = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        for param in rest.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(dur) / 1000
                except ValueError:
                    pass
    return out


def breakdown(samples: Sequence[Sample], n: int = SLOWEST) -> dict[str, float] | None:
    """Mean seconds of hold, prefill and decode side over the ``n`` slowest first tokens.

    None when the answers carry no timing (another router).
    """
    done = sorted(
        (s for s in samples if s.ttft_s is not None and s.timing),
        key=lambda s: s.ttft_s or 0.0,
        reverse=True,
    )[:n]
    if not done:
        return None
    parts = [server_timing(s.timing) for s in done]
    ttfts = [s.ttft_s or 0.0 for s in done]
    sent = [t.get("decode_sent", 0.0) for t in parts]
    return {
        "ttft": sum(ttfts) / len(done),
        "hold": sum(t.get("hold", 0.0) for t in parts) / len(done),
        "prefill": sum(t.get("prefill", 0.0) for t in parts) / len(done),
        "decode_sent": sum(sent) / len(done),
        "after_sent": sum(x - y for x, y in zip(ttfts, sent, strict=True)) / len(done),
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| run | router | failed | decode preemptions | TTFT p50 / p99 (s) | long TTFT p99 (s) "
        "| longest stall p99 (s) | latency p99 (s) | goodput (tok/s) "
        "| decode KV use, mean per server | gap (pp) | prefill holds left |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.get('run', 1)} | {r['router']} | {r['failed']}/{r['requests']} "
        f"| {r['decode_preemptions']} "
        f"| {fmt(r['ttft_p50'])} / {fmt(r['ttft_p99'])} | {fmt(r['long_ttft_p99'])} "
        f"| {fmt(r.get('max_gap_p99'))} | {fmt(r.get('latency_p99'))} "
        f"| {r.get('goodput_tokens_per_s', 0.0):.0f} "
        f"| {' / '.join(f'{100 * v:.0f}%' for v in r['decode_kv_mean'].values())} "
        f"| {r['decode_kv_gap_pp']:.1f} | {r['prefill_held_at_end']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def breakdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """kvroute's slowest first tokens, part by part (rows without timing are left out)."""
    head = (
        f"| run | router | slowest {SLOWEST}: TTFT (s) | hold | prefill | step 2 sent "
        "| after step 2 sent |\n|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.get('run', 1)} | {r['router']} | {b['ttft']:.2f} | {b['hold']:.2f} "
        f"| {b['prefill']:.2f} | {b['decode_sent']:.2f} | {b['after_sent']:.2f} |"
        for r in rows
        if (b := r.get("slowest")) is not None
    ]
    return "\n".join([head, *lines])


def ratios(rows: Sequence[dict[str, Any]]) -> str:
    """kvroute's TTFT p99 over each peer's, per run (the target is at most 0.7)."""
    out = []
    for run in sorted({r.get("run", 1) for r in rows}):
        mine = {r["router"]: r for r in rows if r.get("run", 1) == run}
        ours = mine.get("kvroute")
        if ours is None or ours["ttft_p99"] is None:
            continue
        for name, r in mine.items():
            if name != "kvroute" and r["ttft_p99"]:
                out.append(
                    f"run {run}: kvroute / {name} TTFT p99 = {ours['ttft_p99'] / r['ttft_p99']:.2f}x"
                )
    return "\n".join(out)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["router"].replace(":", "\n") for r in rows]  # a peer and its policy
    names = [f"{name}\nrun {r.get('run', 1)}" for name, r in zip(names, rows, strict=True)]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    xs = range(len(rows))
    axes[0].bar(xs, [r["ttft_p99"] or 0.0 for r in rows], color="tab:blue")
    axes[0].set_title("TTFT p99 (s)")
    axes[1].bar(xs, [r["decode_preemptions"] for r in rows], color="tab:red")
    axes[1].set_title("decode preemptions")
    for i, r in enumerate(rows):
        for j, v in enumerate(r["decode_kv_mean"].values()):
            axes[2].bar(i + 0.35 * j - 0.17, 100 * v, width=0.33, color=f"C{j + 2}")
    axes[2].set_title("decode KV use, mean per server (%)")
    for ax in axes[:3]:
        ax.set_xticks(list(xs), names, fontsize=6)
    _plot_breakdown(axes[3], rows)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _plot_breakdown(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    """kvroute's slowest first tokens: until step 2 was sent, then the decode server's part."""
    mine = [r for r in rows if r.get("slowest") is not None]
    xs = range(len(mine))
    sent = [r["slowest"]["decode_sent"] for r in mine]
    after = [r["slowest"]["after_sent"] for r in mine]
    ax.bar(xs, sent, color="tab:orange", label="until step 2 sent (hold, prefill)")
    ax.bar(xs, after, bottom=sent, color="tab:green", label="decode server (pull, queue)")
    ax.scatter(xs, [r["slowest"]["prefill"] for r in mine], color="black", s=12, label="prefill")
    ax.set_xticks(list(xs), [f"run {r.get('run', 1)}" for r in mine], fontsize=7)
    ax.set_title(f"kvroute: slowest {SLOWEST} TTFT, parts (s)")
    ax.legend(fontsize=6)
