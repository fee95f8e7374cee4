"""``kvroute tune``: search a config's main knobs in simulation and recommend values.

Reads a kvroute config (backends, pools, thresholds, maintenance), simulates the fleet it
describes under the ``kvroute`` policy on a trace or the problem statement's mix, and varies
one knob at a time from the current values: the long pool's size, the long-request
threshold, the safety margin and fragmentation-triggered restarts (maintenance.*). Each knob's best value (fewest failed
requests; ties keep the current value) is then checked together in one final run. Prints
the effect of each as a table and the YAML to paste.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from loadtest.sim.model import SimConfig, SimResult
from loadtest.sim.replicas import replicas_needed
from loadtest.sim.report import write_json
from loadtest.sim.runner import Job, WorkloadSpec, default_jobs, run_jobs
from loadtest.sim.simulator import (
    add_service_options,
    add_workload_options,
    build_workload,
    duration,
)
from loadtest.sim.workload import HoldModel
from proxy.config import Config, ConfigError, load_config
from proxy.routing.policy import PolicySettings

THRESHOLDS = (2_000, 4_000, 8_000, 12_000, 16_000)
MARGINS = (0.0, 0.02, 0.05, 0.1)
RESTART_RATIOS = (0.3, 0.5, 0.7)  # maintenance.restart_below_ratio candidates
NOISE = (
    0.05  # a knob must cut failures by more than this (and > 2 requests) to beat the current value
)


def live_capacities(url: str, timeout_s: float = 2.0) -> list[int]:
    """KV capacities the gateway's ``/fleet`` reports right now (empty if it cannot be read).

    urllib, not httpx: the simulator stays free of the gateway's network stack (one blocking
    GET before any simulation runs).
    """
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/fleet", timeout=timeout_s) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return []
    return [
        int(b["report"]["capacity_tokens"])
        for b in data.get("backends", [])
        if isinstance(b, dict) and b.get("report") and b["report"].get("capacity_tokens")
    ]


def capacity_for(conf: Config, a: argparse.Namespace, given: set[str]) -> tuple[int, str]:
    """Tokens per node and where the number came from, most specific source first:
    --capacity, the config's backends[].capacity_tokens, a live /fleet (--fleet, else the
    gateway at the config's listen address), else the simulator's default, said out loud."""
    if "--capacity" in given:
        return a.capacity, "--capacity"
    caps = sorted(b.capacity_tokens for b in conf.backends if b.capacity_tokens)
    if caps:
        return caps[len(caps) // 2], "the config's backends[].capacity_tokens (median)"
    url = a.fleet or f"http://{conf.listen.host}:{conf.listen.port}"
    live = sorted(live_capacities(url))
    if live:
        return live[len(live) // 2], f"{url}/fleet, as the backends report it (median)"
    return a.capacity, (
        f"ASSUMED: the config sets no capacity_tokens and {url}/fleet did not answer; "
        "pass --fleet URL (a running gateway) or --capacity N"
    )


def fleet_from_config(conf: Config, a: argparse.Namespace) -> SimConfig:
    """The fleet a config describes, as the simulator models it."""
    n = len(conf.backends)
    long_pool = sum(1 for b in conf.backends if conf.pool_role(b.pool) == "long")
    kinds = {b.kind for b in conf.backends}
    allocator = "contiguous" if "contiguous" in kinds else "paged"  # the fragmenting kind decides
    capacity = a.capacity
    m = conf.maintenance
    # Enabled maintenance restarts fragmented nodes (scheduled restarts are not modelled here:
    # `kvroute simulate --restart uptime` compares them).
    restart = "frag" if m.enabled else "none"
    return SimConfig(
        nodes=n,
        long_pool=long_pool,
        capacity_tokens=capacity,
        allocator=allocator,
        block_size=a.block_size,
        prefill_tps=a.prefill_tps,
        decode_tps=a.decode_tps,
        max_concurrency=a.max_concurrency,
        max_attempts=conf.retry.max_attempts,
        ceiling_ttl_s=conf.retry.ceiling_ttl_s,
        queue_wait_s=conf.queue.max_wait_s,
        queue_max=conf.queue.max_size,
        settings=PolicySettings(
            safety_margin=conf.routing.safety_margin,
            stale_after_s=conf.collector.stale_after_s,
            long_threshold_tokens=conf.routing.long_threshold_tokens,
        ),
        hold=HoldModel(a.hold_fraction, a.hold_alpha, a.hold_min, a.hold_max, a.hold_max_tokens),
        restart=restart,
        restart_frag=1.0 - m.restart_below_ratio,
        restart_frag_for_s=m.restart_after_s,
        restart_min_free=m.min_free_fraction,
        restart_min_interval_s=m.min_interval_per_node_s,
        drain_timeout_s=m.drain_timeout_s,
        seed=a.seed,
    )


@dataclass(frozen=True)
class Candidate:
    knob: str
    label: str
    cfg: SimConfig


def candidates(base: SimConfig) -> list[Candidate]:
    """Every single-knob variation of ``base`` worth a run (the current value included once)."""
    n = base.nodes
    out = [Candidate("current", "current", base)]
    pools = sorted({0, round(n / 4), round(n / 2), round(3 * n / 4), n - 1} - {base.long_pool})
    out += [Candidate("long_pool", str(k), replace(base, long_pool=k)) for k in pools if 0 <= k < n]
    s = base.settings
    out += [
        Candidate(
            "long_threshold_tokens",
            str(t),
            replace(base, settings=replace(s, long_threshold_tokens=t)),
        )
        for t in THRESHOLDS
        if t != s.long_threshold_tokens
    ]
    out += [
        Candidate("safety_margin", f"{m:g}", replace(base, settings=replace(s, safety_margin=m)))
        for m in MARGINS
        if m != s.safety_margin
    ]
    restarts = [Candidate("restart", "none", replace(base, restart="none"))]
    restarts += [
        Candidate(
            "restart", f"below_ratio {r:g}", replace(base, restart="frag", restart_frag=1.0 - r)
        )
        for r in RESTART_RATIOS
    ]
    out += [c for c in restarts if _restart_label(base) != c.label]
    return out


def _restart_label(cfg: SimConfig) -> str:
    if cfg.restart == "frag":
        return f"below_ratio {1.0 - cfg.restart_frag:g}"
    return "none"


def current_label(base: SimConfig, knob: str) -> str:
    return {
        "long_pool": str(base.long_pool),
        "long_threshold_tokens": str(base.settings.long_threshold_tokens),
        "safety_margin": f"{base.settings.safety_margin:g}",
        "restart": _restart_label(base),
    }[knob]


def better(r: SimResult, than: SimResult) -> bool:
    """Fewer failed requests beyond noise (2.5 sigma of a Poisson count, and at least 5%);
    with equal failures, fewer restarts."""
    gap = than.failures - r.failures
    if gap > noise(than.failures, r.failures):
        return True
    return r.failures == than.failures and r.restarts < than.restarts


def apply(base: SimConfig, knob: str, cfg: SimConfig) -> SimConfig:
    """``base`` with one knob taken from ``cfg``."""
    if knob == "long_pool":
        return replace(base, long_pool=cfg.long_pool)
    if knob == "long_threshold_tokens":
        return replace(
            base,
            settings=replace(
                base.settings, long_threshold_tokens=cfg.settings.long_threshold_tokens
            ),
        )
    if knob == "safety_margin":
        return replace(
            base, settings=replace(base.settings, safety_margin=cfg.settings.safety_margin)
        )
    return replace(base, restart=cfg.restart, restart_frag=cfg.restart_frag)


def yaml_snippet(conf: Config, rec: SimConfig) -> str:
    """What to paste: routing, pools, the backends' pool membership, maintenance."""
    names = [b.name for b in conf.backends]
    long_now = [b.name for b in conf.backends if conf.pool_role(b.pool) == "long"]
    # Keep today's long-pool members first, then take general backends from the end of the list.
    order = long_now + [x for x in reversed(names) if x not in long_now]
    long_set = set(order[: rec.long_pool])
    long_pool_name = next((p for p, pc in conf.pools.items() if pc.role == "long"), "long")
    general_name = next((p for p, pc in conf.pools.items() if pc.role == "general"), "general")
    backends = []
    for b in conf.backends:
        rest = b.model_dump(mode="json", exclude_defaults=True, exclude={"name", "url", "pool"})
        pool = long_pool_name if b.name in long_set else general_name
        backends.append({"name": b.name, "url": b.base_url, "pool": pool, **rest})
    maintenance: dict[str, Any] = {"enabled": rec.restart == "frag"}
    if rec.restart == "frag":
        maintenance["restart_below_ratio"] = round(1.0 - rec.restart_frag, 3)
        maintenance["restart_after_s"] = rec.restart_frag_for_s
    doc = {
        "routing": {
            "long_threshold_tokens": rec.settings.long_threshold_tokens,
            "safety_margin": rec.settings.safety_margin,
        },
        "pools": {general_name: {"role": "general"}, long_pool_name: {"role": "long"}},
        "backends": backends,
        "maintenance": maintenance,
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvroute tune",
        description="Search routing, pool and restart knobs in simulation; recommend values.",
    )
    ap.add_argument(
        "--config", required=True, help="kvroute config file (backends, pools, thresholds)"
    )
    ap.add_argument(
        "--duration",
        type=duration,
        default=6 * 3_600.0,
        help="simulated time per candidate (default 6h)",
    )
    ap.add_argument(
        "--replicas",
        action="store_true",
        help="also compare the replicas needed, current vs recommended",
    )
    ap.add_argument(
        "--target", type=float, default=0.001, help="failure-rate target for --replicas"
    )
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--json", metavar="FILE", help="write every candidate's result as JSON")
    ap.add_argument("--quick", action="store_true", help="CI-sized: 1h per candidate")
    ap.add_argument(
        "--fleet",
        metavar="URL",
        help="a running gateway whose /fleet gives the backends' KV capacities "
        "(default: the config's listen address, when the config sets no capacity_tokens)",
    )
    ap.add_argument("--no-progress", action="store_true")
    add_service_options(ap)
    add_workload_options(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(args)
    given = {x.split("=")[0] for x in args}
    if "--workload" not in given:
        a.workload = "trace" if "--trace" in given else "problem"
    if a.quick and "--duration" not in given:
        a.duration = 3_600.0
    con = Console(width=None if sys.stdout.isatty() else 150)
    try:
        conf = load_config(a.config)
        a.capacity, capacity_source = capacity_for(conf, a, given)
        base = fleet_from_config(conf, a)
        spec = build_workload(a, base)
        rec, rows, results = search(base, spec, a.duration, a.jobs, not a.no_progress)
    except (ConfigError, ValueError, OSError) as exc:
        con.print(f"[red]error:[/red] {exc}")
        return 2
    con.print(
        f"{a.config}: {base.nodes} backends ({base.allocator}, {base.capacity_tokens:,} tokens each), "
        f"long pool {base.long_pool}; workload {spec.kind}; {a.duration / 3_600:g}h simulated per candidate"
    )
    con.print(f"capacity per node from {capacity_source}", markup=False)
    con.print(result_table(rows))
    con.print("\n[bold]Why each recommendation[/bold] (failed requests in the same simulated run):")
    for line in explain(rows):
        con.print(f"- {line}", markup=False, highlight=False)
    if a.replicas:
        reps = {}
        for label, cfg in (("current", base), ("recommended", rec)):
            reps[label] = replicas_needed(
                cfg,
                ["kvroute"],
                spec,
                a.duration,
                a.target,
                4 * base.nodes,
                a.jobs,
                not a.no_progress,
            )["kvroute"]
        for label, s in reps.items():
            con.print(
                f"replicas needed for < {100 * a.target:g}% failures, {label} config: {s.needed if s.needed is not None else f'>{s.max_nodes}'}"
            )
    con.print("\n[bold]Recommended config (paste into your kvroute YAML):[/bold]")
    con.print(yaml_snippet(conf, rec), markup=False, highlight=False)
    if a.json:
        write_json(
            a.json,
            {
                "config": a.config,
                "workload": spec.describe(),
                "duration_s": a.duration,
                "candidates": results,
            },
        )
    return 0


Row = tuple[str, str, str, SimResult, SimResult, str, dict[str, int]]


def noise(a: int, b: int) -> float:
    """The gap two failure counts must exceed to count as a difference (see ``better``)."""
    return max(2.5 * math.sqrt(a + b), NOISE * a, 2.0)


def explain(rows: list[Row]) -> list[str]:
    """One sentence per knob: what was recommended, and the measured effect that decided it."""
    out = []
    for knob, now, best, cur, r, _, tried in rows:
        if knob == "all together":
            out.append(
                f"all recommendations together: {cur.failures:,} -> {r.failures:,} failed "
                f"({_pct(cur.failures, r.failures)}), {r.restarts} restarts"
            )
            continue
        if best != now:
            out.append(
                f"{knob}: {now} -> {best}: {cur.failures:,} -> {r.failures:,} failed "
                f"({_pct(cur.failures, r.failures)}), more than the noise of ±{noise(cur.failures, r.failures):.0f}"
                + (
                    f"; restarts {cur.restarts} -> {r.restarts}"
                    if cur.restarts != r.restarts
                    else ""
                )
            )
            continue
        lowest = min(tried.items(), key=lambda kv: kv[1], default=None)
        if lowest is None or lowest[1] >= cur.failures:
            out.append(f"{knob}: keep {now}: no other value failed fewer ({cur.failures:,} failed)")
        else:
            out.append(
                f"{knob}: keep {now}: {lowest[0]} failed {lowest[1]:,} vs {cur.failures:,}, "
                f"within the run's noise (±{noise(cur.failures, lowest[1]):.0f}), so not worth a change"
            )
    return out


def _pct(before: int, after: int) -> str:
    if before == 0:
        return "no change" if after == 0 else f"+{after}"
    return f"{100 * (after - before) / before:+.0f}%"


def search(
    base: SimConfig, spec: WorkloadSpec, dur: float, jobs: int, show: bool
) -> tuple[SimConfig, list[Row], list[dict[str, Any]]]:
    """Run every single-knob candidate, pick each knob's best, then run them together."""
    cands = candidates(base)
    res = run_jobs(
        [Job(f"{c.knob}={c.label}", c.cfg, "kvroute", spec, dur) for c in cands],
        jobs,
        show,
        title="tune",
    )
    cur = res["current=current"]
    rec = base
    rows: list[Row] = []
    for knob in ("long_pool", "long_threshold_tokens", "safety_margin", "restart"):
        best_label, best = current_label(base, knob), cur
        for c in cands:
            r = res[f"{c.knob}={c.label}"]
            if c.knob == knob and better(r, best):
                best_label, best = c.label, r
                rec = apply(rec, knob, c.cfg)
        per_value = {c.label: res[f"{c.knob}={c.label}"].failures for c in cands if c.knob == knob}
        tried = " · ".join(f"{label}: {n:,}" for label, n in per_value.items())
        rows.append((knob, current_label(base, knob), best_label, cur, best, tried, per_value))
    combined = run_jobs([Job("combined", rec, "kvroute", spec, dur)], 1, show, title="tune")[
        "combined"
    ]
    rows.append(("all together", "-", "-", cur, combined, "", {}))
    dump = [
        {"knob": c.knob, "value": c.label, **res[f"{c.knob}={c.label}"].summary()} for c in cands
    ]
    dump.append({"knob": "combined", "value": "recommended", **combined.summary()})
    return rec, rows, dump


def result_table(rows: list[Row]) -> Table:
    t = Table(title="kvroute tune (policy kvroute)", title_justify="left")
    for col in (
        "knob",
        "current",
        "recommended",
        "failed: current",
        "failed: recommended",
        "fail %",
        "restarts",
        "failed with the other values tried",
    ):
        t.add_column(
            col, justify="right" if col.startswith(("failed:", "fail %", "restarts")) else "left"
        )
    for knob, now, best, cur, r, tried, _ in rows:
        t.add_row(
            knob,
            now,
            best,
            f"{cur.failures:,}",
            f"{r.failures:,}",
            f"{100 * r.failure_rate:.3f}%",
            str(r.restarts),
            tried,
        )
    return t


if __name__ == "__main__":
    raise SystemExit(main())
