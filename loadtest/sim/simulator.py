"""``kvroute simulate``: the offline fleet simulator's command line.

Runs the gateway's routing policies (plus the ``oracle`` no-fragmentation bound) over the
same simulated request stream against contiguous or paged allocator models, prints a
table, and optionally writes JSON, PNG plots and the replicas each policy needs.
The engine is ``loadtest.sim.engine``; this module only turns options into runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from loadtest.sim.model import POLICY_NAMES, RESTART_MODES, SimConfig, SimResult
from loadtest.sim.replicas import ReplicaSearch, replicas_needed
from loadtest.sim.report import document, print_report, write_json
from loadtest.sim.runner import Job, WorkloadSpec, at_load, default_jobs, offered_load, run_jobs
from loadtest.sim.workload import HoldModel, parse_mix, problem_mix
from proxy.config import QueueConfig, RetryConfig, RoutingConfig
from proxy.routing.policy import PolicySettings

DEFAULT_TRACE = str(
    Path(__file__).resolve().parent.parent / "data" / "AzureLLMInferenceTrace_code.csv"
)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3_600.0, "d": 86_400.0}


def duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``12h``, ``6d`` (also ``1.5d``) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 12h, 6d)")
    value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive: {text!r}")
    return value


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICY_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {bad or text!r}; choose from {','.join(POLICY_NAMES)}"
        )
    return names


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1): {text}")
    return v


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return v


def add_fleet_options(ap: argparse.ArgumentParser) -> None:
    """The fleet's shape (``kvroute tune`` reads it from the config file instead)."""
    f = ap.add_argument_group("fleet")
    f.add_argument("--nodes", type=int, default=8, help="fleet size (default 8)")
    f.add_argument(
        "--long-pool",
        type=int,
        default=None,
        help="nodes in the long pool (kvroute only; default nodes-1)",
    )
    f.add_argument("--allocator", choices=("contiguous", "paged"), default="contiguous")
    add_service_options(ap)
    add_workload_options(ap)


def add_service_options(ap: argparse.ArgumentParser) -> None:
    """Options shared with ``kvroute tune``: node memory and the service-time model."""
    f = ap.add_argument_group("nodes")
    f.add_argument(
        "--capacity",
        type=int,
        default=131_072,
        help="KV capacity per node, tokens (default 131072)",
    )
    f.add_argument("--block-size", type=int, default=16, help="paged block size, tokens")
    f.add_argument(
        "--prefill-tps", type=_positive, default=10_000.0, help="prompt tokens/s per request"
    )
    f.add_argument(
        "--decode-tps", type=_positive, default=30.0, help="output tokens/s per sequence"
    )
    f.add_argument(
        "--max-concurrency", type=int, default=0, help="sequences per node, 0 = unlimited"
    )


def add_workload_options(ap: argparse.ArgumentParser) -> None:
    """Options shared with ``kvroute tune``: the request stream."""
    w = ap.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=("problem", "mix", "trace"),
        default="problem",
        help="problem: the 70/30 short/long mix",
    )
    w.add_argument(
        "--mix", default=None, help="kind:share:plo-phi:olo-ohi,... (with --workload mix)"
    )
    w.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="CSV/JSONL trace (with --workload trace; default: the bundled Azure code trace)",
    )
    w.add_argument(
        "--length-scale", type=_positive, default=1.0, help="trace prompt lengths x this"
    )
    w.add_argument(
        "--rate-scale",
        type=_positive,
        default=None,
        help="trace arrivals x this faster (default: from --load)",
    )
    w.add_argument(
        "--rate", type=_positive, default=None, help="arrivals per second (default: from --load)"
    )
    w.add_argument(
        "--load",
        type=_positive,
        default=0.55,
        help="offered KV load (requests only, not retained sessions) as a fraction of fleet capacity (default 0.55)",
    )
    w.add_argument(
        "--hold-fraction",
        type=_fraction,
        default=0.002,
        help="share of chat-sized requests (see --hold-max-tokens) whose KV stays resident after they finish (sessions)",
    )
    w.add_argument(
        "--hold-alpha", type=_positive, default=0.5, help="Pareto shape of that extra holding time"
    )
    w.add_argument(
        "--hold-min", type=duration, default=3_600.0, help="Pareto scale (shortest hold)"
    )
    w.add_argument("--hold-max", type=duration, default=7 * 86_400.0, help="longest hold")
    w.add_argument(
        "--hold-max-tokens",
        type=int,
        default=1_000,
        help="only requests up to this demand are retained",
    )
    w.add_argument("--seed", type=int, default=1)


def add_gateway_options(ap: argparse.ArgumentParser) -> None:
    # The gateway's own defaults, read from the config model rather than retyped here.
    routing, retry, queue = RoutingConfig(), RetryConfig(), QueueConfig()
    g = ap.add_argument_group("gateway")
    g.add_argument(
        "--long-threshold",
        type=int,
        default=routing.long_threshold_tokens,
        help="routing.long_threshold_tokens",
    )
    g.add_argument(
        "--safety-margin",
        type=_fraction,
        default=routing.safety_margin,
        help="routing.safety_margin",
    )
    g.add_argument(
        "--max-attempts", type=int, default=retry.max_attempts, help="retry.max_attempts"
    )
    g.add_argument(
        "--client-retries", type=int, default=0, help="blind client retries after a failure"
    )
    g.add_argument("--client-retry-delay", type=duration, default=2.0)
    g.add_argument(
        "--report-lag",
        type=duration,
        default=None,
        help="scrape interval: decisions see reports this old (default: fresh)",
    )
    g.add_argument(
        "--ceiling-ttl", type=duration, default=retry.ceiling_ttl_s, help="retry.ceiling_ttl_s"
    )
    g.add_argument(
        "--queue-wait",
        type=float,
        default=queue.max_wait_s,
        help="queue.max_wait_s: seconds a request nothing fits may wait (0: fail at once)",
    )
    g.add_argument("--queue-max", type=int, default=queue.max_size, help="queue.max_size")
    r = ap.add_argument_group("restarts")
    r.add_argument(
        "--restart",
        choices=RESTART_MODES,
        default="none",
        help="none | uptime (scheduled) | frag (fragmentation-triggered)",
    )
    r.add_argument(
        "--restart-uptime",
        type=duration,
        default=6 * 86_400.0,
        help="maintenance.scheduled_restart_uptime_s (with --restart uptime)",
    )
    r.add_argument(
        "--restart-frag",
        type=_fraction,
        default=0.5,
        help="1 - maintenance.restart_below_ratio: fragmentation that triggers a restart ...",
    )
    r.add_argument(
        "--restart-frag-for",
        type=duration,
        default=300.0,
        help="... maintenance.restart_after_s: sustained this long",
    )
    r.add_argument(
        "--restart-min-free",
        type=_fraction,
        default=0.1,
        help="... maintenance.min_free_fraction: while this much is free",
    )
    r.add_argument(
        "--restart-min-interval",
        type=duration,
        default=3_600.0,
        help="maintenance.min_interval_per_node_s",
    )
    r.add_argument(
        "--restart-downtime",
        type=duration,
        default=120.0,
        help="a restart takes the node out this long",
    )
    r.add_argument(
        "--drain-timeout", type=duration, default=300.0, help="maintenance.drain_timeout_s"
    )


def default_long_pool(nodes: int) -> int:
    """Three quarters of the fleet: on the problem statement's mix over six simulated days
    (8 nodes) a long pool of 6 failed 0.150% of requests, 5: 0.152%, 4: 0.186%, 7: 0.280%
    (one general node fills up with retained session KV and short requests spill)."""
    return max(1, min(nodes - 1, round(0.75 * nodes))) if nodes > 1 else 0


def build_config(a: argparse.Namespace) -> SimConfig:
    if a.nodes < 1:
        raise SystemExit("--nodes must be at least 1")
    pool = a.long_pool if a.long_pool is not None else default_long_pool(a.nodes)
    if not 0 <= pool <= a.nodes:
        raise SystemExit(f"--long-pool must be within 0..{a.nodes}")
    lag = getattr(a, "report_lag", None) or 0.0
    return SimConfig(
        nodes=a.nodes,
        long_pool=pool,
        capacity_tokens=a.capacity,
        allocator=a.allocator,
        block_size=a.block_size,
        prefill_tps=a.prefill_tps,
        decode_tps=a.decode_tps,
        max_concurrency=a.max_concurrency,
        max_attempts=a.max_attempts,
        client_retries=a.client_retries,
        client_retry_delay_s=a.client_retry_delay,
        report_lag_s=lag,
        ceiling_ttl_s=a.ceiling_ttl,
        queue_wait_s=a.queue_wait,
        queue_max=a.queue_max,
        settings=PolicySettings(
            safety_margin=a.safety_margin,
            stale_after_s=max(5.0, 2.5 * lag),
            long_threshold_tokens=a.long_threshold,
        ),
        hold=HoldModel(a.hold_fraction, a.hold_alpha, a.hold_min, a.hold_max, a.hold_max_tokens),
        restart=a.restart,
        restart_uptime_s=a.restart_uptime,
        restart_frag=a.restart_frag,
        restart_frag_for_s=a.restart_frag_for,
        restart_min_free=a.restart_min_free,
        restart_min_interval_s=a.restart_min_interval,
        restart_downtime_s=a.restart_downtime,
        drain_timeout_s=a.drain_timeout,
        series_s=a.series,
        seed=a.seed,
    )


def build_workload(a: argparse.Namespace, cfg: SimConfig) -> WorkloadSpec:
    if a.workload == "trace":
        spec = WorkloadSpec(kind="trace", trace=a.trace, length_scale=a.length_scale, seed=a.seed)
        return (
            replace(spec, rate_scale=a.rate_scale) if a.rate_scale else at_load(spec, cfg, a.load)
        )
    mix = problem_mix() if a.workload == "problem" else parse_mix(a.mix or "")
    spec = WorkloadSpec(kind="mix", mix=tuple(mix), seed=a.seed)
    return replace(spec, rate_per_s=a.rate) if a.rate else at_load(spec, cfg, a.load)


@dataclass
class Outcome:
    cfg: SimConfig
    workload: WorkloadSpec
    duration_s: float
    results: dict[str, SimResult]
    replicas: dict[str, ReplicaSearch] | None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvroute simulate",
        description="Offline fleet simulator: routing policies against fragmenting KV allocators over simulated days.",
    )
    ap.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICY_NAMES),
        help=f"comma list (default {','.join(POLICY_NAMES)})",
    )
    ap.add_argument(
        "--duration",
        type=duration,
        default=86_400.0,
        help="simulated time, e.g. 6d, 12h (default 1d)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="CI-sized preset: 6 nodes, 3h, replicas over 1h"
    )
    add_fleet_options(ap)
    add_gateway_options(ap)
    o = ap.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write results as JSON")
    o.add_argument("--json-series", action="store_true", help="include the time series in the JSON")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    o.add_argument(
        "--series", type=duration, default=900.0, help="time-series resolution (default 15m)"
    )
    o.add_argument(
        "--replicas", action="store_true", help="also search the fleet size each policy needs"
    )
    o.add_argument(
        "--target",
        type=_fraction,
        default=0.001,
        help="failure-rate target for --replicas (default 0.001 = 0.1%%)",
    )
    o.add_argument(
        "--replicas-duration",
        type=duration,
        default=None,
        help="simulated time per replicas probe (default min(duration, 12h))",
    )
    o.add_argument("--max-nodes", type=int, default=64)
    o.add_argument(
        "--jobs", type=int, default=default_jobs(), help="worker processes (default: up to 2)"
    )
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--legend", action="store_true", help="explain the columns under the table")
    return ap


def apply_quick(a: argparse.Namespace, argv: Sequence[str]) -> None:
    given = {x.split("=")[0] for x in argv if x.startswith("--")}
    if "--nodes" not in given:
        a.nodes = 6
    if "--duration" not in given:
        a.duration = 3 * 3_600.0
    if "--replicas-duration" not in given:
        a.replicas_duration = 3_600.0
    if "--series" not in given:
        a.series = 600.0
    if "--hold-min" not in given:
        a.hold_min = 600.0  # retention builds up within the short run


def execute(a: argparse.Namespace, console: Console | None = None) -> Outcome:
    cfg = build_config(a)
    spec = build_workload(a, cfg)
    show = not a.no_progress
    jobs = [Job(p, cfg, p, spec, a.duration) for p in a.policies]
    results = run_jobs(jobs, a.jobs, show)
    reps = None
    if a.replicas:
        horizon = a.replicas_duration or min(a.duration, 12 * 3_600.0)
        reps = replicas_needed(cfg, a.policies, spec, horizon, a.target, a.max_nodes, a.jobs, show)
    return Outcome(cfg, spec, a.duration, {p: results[p] for p in a.policies}, reps)


def _human(seconds: float) -> str:
    for unit, size in (("d", 86_400.0), ("h", 3_600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(args)
    if a.plots and not all(importlib.util.find_spec(m) for m in ("matplotlib", "PIL")):
        # Say so before a run of minutes, not after it.
        print("--plots needs matplotlib and Pillow: pip install 'kvroute[sim]'", file=sys.stderr)
        return 2
    if a.quick:
        apply_quick(a, args)
    con = Console(width=None if sys.stdout.isatty() else 150)
    started = time.monotonic()
    try:
        out = execute(a, con)
    except (ValueError, OSError) as exc:
        con.print(f"[red]error:[/red] {exc}")
        return 2
    load = offered_load(out.workload, out.cfg)
    rate = out.workload.describe().get("rate_per_s")
    con.print(
        f"{out.cfg.nodes} nodes x {out.cfg.capacity_tokens:,} tokens ({out.cfg.allocator}), long pool {out.cfg.long_pool}, "
        f"{_human(out.duration_s)} simulated, offered KV load {load:.2f}"
        + (f", {rate:.2f} req/s" if rate else "")
        + f"; {time.monotonic() - started:.0f} s wall"
    )
    print_report(out.results, out.replicas, a.target, con, legend=a.legend)
    if a.json:
        write_json(
            a.json,
            document(
                out.cfg,
                out.workload,
                out.duration_s,
                out.results,
                out.replicas,
                a.target,
                a.json_series,
            ),
        )
        con.print(f"wrote {a.json}")
    if a.plots:
        from loadtest.sim.plots import write_plots

        for p in write_plots(out.results, a.plots, out.replicas, a.target):
            con.print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
