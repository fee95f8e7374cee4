"""Big prompts at high concurrency: direct vs vllm-router vs kvroute, in one run.

Starts trivial backends (``loadtest.engine.trivial``, answers pre-built) and, one target
after another, drives with wrk (bodies cycled by Lua, ``big_prompts_load``):

- ``shared``: 64 bodies, each a distinct first line then the same ~220 KB document
  (about 50,000 tokens), at 150 connections: document Q&A as clients send it;
- ``unique``: 64 bodies, every document different;
- ``tiny`` at 64 connections and at 1: the overhead benchmark's "Say hi." request;
- ``lone``: 30k-token prompts sent one at a time, interleaved across targets, as the
  client measures them: ``same`` (one body sent again and again), ``repeat`` (the same
  document behind a new first line each time) and ``fresh`` (a new document each time: a
  full encode). Added = target - direct.

Targets: ``direct`` (backend 0), ``vllm-router --policy round_robin`` (where on PATH), and
``kvroute serve`` (embedded store); with ``--workers`` counts above 1, also ``kvroute serve``
on a local Redis with 1 and with each of those workers counts (several workers need it). Each row prints req/s and its ratio
to vllm-router's, p50/p99, errors, and the target's CPU ms per request.

    python -m loadtest.bench.big_prompts --quick --json out/big_prompts.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench.big_prompts_load import (
    chat_body,
    lone_latency,
    run_wrk_bodies,
    send_each,
    shared_document_bodies,
    unique_document_bodies,
    write_bodies,
)
from loadtest.bench.overhead_load import (
    CHAT_PATH,
    cpu_seconds,
    find_wrk,
    request_body,
    run_wrk,
)
from loadtest.bench.overhead_report import loadavg
from loadtest.bench.overhead_targets import Bench, Target, wait_post_ok
from loadtest.local_fleet import Proc, free_port
from loadtest.workload import make_prompt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.big_prompts", description=__doc__)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per target and case")
    p.add_argument("--concurrency", type=int, default=150, help="connections for big prompts")
    p.add_argument("--tiny-concurrency", type=int, default=64)
    p.add_argument("--bodies", type=int, default=64)
    p.add_argument("--doc-chars", type=int, default=220_000)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--workers", default="1,2", help="kvroute --workers counts, comma-separated")
    p.add_argument("--lone", type=int, default=20, help="30k-token prompts per lone case")
    p.add_argument("--cases", default="shared,unique,tiny,lone")
    p.add_argument("--vllm-router", default=None, help="path to vllm-router (default: PATH)")
    p.add_argument("--no-vllm-router", action="store_true", help="leave vllm-router out")
    p.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="also run `kvroute serve` from this source tree (e.g. a checkout of main) as "
        "kvroute-baseline: the before/after ratio measured in the same run",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="points per target and load case, the targets' order reversed each round; rows "
        "show medians, and x router the median of each round's ratio (on a shared VM two "
        "points a minute apart differ by more than the builds compared)",
    )
    p.add_argument("--quick", action="store_true", help="3 s per point, 10 lone prompts")
    p.add_argument(
        "--warm",
        action="store_true",
        help="send every body once to each target before its timed point (the steady state "
        "of clients cycling the same bodies, not their first pass)",
    )
    p.add_argument("--json", type=Path, default=None)
    # What Bench (loadtest.bench.overhead_targets) reads.
    p.add_argument("--stream-chunks", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--policy", default="kvroute", help="kvroute routing.policy")
    p.add_argument(
        "--route-on-bound",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kvroute's sizing.route_on_bound (default: the config's, on; unset, the "
        "baseline's config also works for code from before the setting)",
    )
    return p


def start_targets(bench: Bench, workers: list[int]) -> list[Target]:
    targets = [bench.direct()]
    router = None if bench.args.no_vllm_router else bench.vllm_router()
    if router is not None:
        targets.append(router)
    if bench.args.baseline_src is not None:
        targets.append(baseline(bench, bench.args.baseline_src.resolve()))
    if 1 in workers:
        targets.append(bench.kvroute("kvroute", redis=False))
    if any(w > 1 for w in workers):
        # More than one worker needs the shared store: 1 worker on Redis is their baseline.
        for w in sorted({1, *workers}):
            name = "kvroute-redis" if w == 1 else f"kvroute-redis-w{w}"
            targets.append(bench.kvroute(name, redis=True, workers=w))
    return targets


def baseline(bench: Bench, src: Path) -> Target:
    """``kvroute serve`` imported from ``src`` (its ``proxy`` first on sys.path), embedded store."""
    port = free_port()
    cfg = bench.gateway_config_path("kvroute-baseline", redis=False)
    boot = f"import sys; sys.path.insert(0, {str(src)!r}); from proxy.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", boot, "serve", "--config", str(cfg), "--port", str(port)]
    argv += ["--log-level", "warning"]
    p = bench.start(Proc("kvroute-baseline", argv, f"http://127.0.0.1:{port}"), env=bench.env())
    wait_post_ok(p.url, proc=p)
    return Target("kvroute-baseline", p.url, [p], f"kvroute serve from {src}")


def point(target: Target, run: Any) -> dict[str, Any]:
    """One load run against ``target`` with its CPU time per request."""
    before = cpu_seconds(target.pids)
    load = run(target.url)
    cpu = cpu_seconds(target.pids) - before
    return {
        "target": target.name,
        "rps": round(load.rps, 1),
        "p50_ms": round(load.p50_ms, 2),
        "p99_ms": round(load.p99_ms, 2),
        "requests": load.requests,
        "errors": load.errors,
        "cpu_ms_per_req": round(1000 * cpu / load.requests, 3) if load.requests else None,
    }


def rounds(targets: list[Target], run: Any, n: int) -> list[dict[str, Any]]:
    """``n`` points per target, in order then reversed, alternately; one row per target."""
    points: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for i in range(n):
        for t in targets if i % 2 == 0 else targets[::-1]:
            points[t.name].append(point(t, run))
    router = points.get("vllm-router")
    return [summary(points[t.name], router) for t in targets]


def summary(points: list[dict[str, Any]], router: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One target's points as one row: medians, errors and requests summed, and its ratio
    to vllm-router's req/s taken round by round (the median of those)."""
    row = dict(points[0])
    if len(points) > 1:
        for key in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req"):
            values = [p[key] for p in points if p[key] is not None]
            row[key] = round(statistics.median(values), 3) if values else None
        row["requests"] = sum(p["requests"] for p in points)
        row["errors"] = sum(p["errors"] for p in points)
        row["rounds_rps"] = [p["rps"] for p in points]
    if router is not None:
        ratios = [p["rps"] / r["rps"] for p, r in zip(points, router, strict=True) if r["rps"]]
        row["x_router"] = round(statistics.median(ratios), 3) if ratios else None
    return row


def load_cases(args: argparse.Namespace, bench: Bench, targets: list[Target]) -> dict[str, Any]:
    wrk = find_wrk()
    if wrk is None:
        raise SystemExit("wrk is required (Debian package `wrk`)")
    cases = args.cases.split(",")
    runs: dict[str, Any] = {}
    makers = {"shared": shared_document_bodies, "unique": unique_document_bodies}
    for case, make in makers.items():
        if case not in cases:
            continue
        bodies = make(args.bodies, args.doc_chars)
        script = write_bodies(bodies, bench.workdir, case)
        if args.warm:
            for t in targets:
                send_each(t.url, bodies)
        runs[case] = rounds(
            targets,
            lambda url, s=script: run_wrk_bodies(wrk, url, s, args.concurrency, args.duration),
            args.rounds,
        )
        print_rows(case, f"c={args.concurrency}", runs[case])
    if "tiny" in cases:
        for conc in (args.tiny_concurrency, 1):
            key = f"tiny_c{conc}"
            runs[key] = rounds(
                targets,
                lambda url, c=conc: run_wrk(
                    wrk, url + CHAT_PATH, request_body(False), c, args.duration, bench.workdir
                ),
                args.rounds,
            )
            print_rows("tiny", f"c={conc}", runs[key])
    return runs


def lone_cases(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    """30k-token prompts alone: the same document behind new heads, and fresh documents."""
    urls = {t.name: t.url for t in targets}
    doc = make_prompt(30_000)
    same = chat_body(f"Summarise.\n{doc}")
    repeat = [chat_body(f"Request {i}: summarise.\n{doc}") for i in range(args.lone)]
    fresh = [chat_body(make_prompt(30_000, random.Random(i))) for i in range(1, args.lone + 1)]
    out: dict[str, Any] = {}
    cases = (("same", [same] * args.lone), ("repeat", repeat), ("fresh", fresh))
    for name, bodies in cases:
        lone = lone_latency(urls, bodies)
        base = lone.p50_ms["direct"]
        out[name] = {
            "p50_ms": {k: round(v, 2) for k, v in lone.p50_ms.items()},
            "added_p50_ms": {k: round(v - base, 2) for k, v in lone.p50_ms.items()},
            "requests": lone.requests,
            "body_bytes": len(bodies[0]),
        }
        added = ", ".join(f"{k} +{v:.2f} ms" for k, v in out[name]["added_p50_ms"].items())
        print(f"lone 30k-token prompt ({name}): direct p50 {base:.2f} ms; added p50: {added}")
    return out


def print_rows(case: str, conc: str, rows: list[dict[str, Any]]) -> None:
    rounds_note = (
        f", median of {len(rows[0]['rounds_rps'])} rounds" if "rounds_rps" in rows[0] else ""
    )
    print(f"\n{case} ({conc}{rounds_note})")
    print(
        f"{'target':14s} {'req/s':>8s} {'x router':>9s} {'p50 ms':>9s} {'p99 ms':>9s} "
        f"{'errors':>7s} {'cpu ms/req':>10s}"
    )
    for r in rows:
        ratio = f"{r['x_router']:.2f}" if r.get("x_router") is not None else "-"
        print(
            f"{r['target']:14s} {r['rps']:8.1f} {ratio:>9s} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} "
            f"{r['errors']:7d} {r['cpu_ms_per_req'] or 0:10.3f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration, args.lone = 3.0, 10
    workers = [int(w) for w in args.workers.split(",") if w]
    bench = Bench(args)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    result["loadavg_before"] = loadavg()
    try:
        bench.start_backends()
        targets = start_targets(bench, workers)
        result["targets"] = {t.name: t.note for t in targets}
        result["skipped"] = bench.skipped
        for name, why in bench.skipped.items():
            print(f"skipped {name}: {why}")
        result["load"] = load_cases(args, bench, targets)
        if "lone" in args.cases.split(","):
            result["lone"] = lone_cases(args, targets)
    finally:
        bench.stop_all()
    result["loadavg_after"] = loadavg()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
