"""Do no harm: kvroute against vllm-router's policies on engines it was not tuned on.

kvroute's rules for paged engines were tuned on one simulated engine; on an independent
vLLM-like engine it lost to vllm-router's blind ``power_of_two``. This benchmark runs the
same open-loop request list through kvroute (its default config for ``kind: vllm``
backends: no pools, no rates, nothing tuned) and through vllm-router's ``power_of_two``,
``cache_aware`` and ``round_robin``, over a grid of cells each bound by one thing
(``do_no_harm_cells``), on two engine models (``classic`` configured as an independent vLLM-like engine,
and ``v1``, vLLM v1's scheduler), with fresh engines for every router, and prints a verdict
per cell against its targets (``do_no_harm_report``).

vllm-router is found on PATH or in /tmp/vllm-router-venv (``python -m venv
/tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router``); without it its
rows are skipped with the reason printed, and no verdict can be given.

    python -m loadtest.bench do-no-harm --runs 1 --duration 15 --cells prefill,memory --json out/dnh.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import queueing as q
from loadtest.bench.do_no_harm_cells import (
    CELLS,
    DEFAULT_CELLS,
    MODELS,
    Cell,
    model_flags,
    workload,
)
from loadtest.bench.do_no_harm_report import summarise, table, verdicts
from loadtest.bench.engine_fleet import counter, start_gateway, start_vllm_engine, start_vllm_router
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.children import stop_processes
from loadtest.local_fleet import free_port
from loadtest.workload import Request

ROUTERS = ("kvroute", "power_of_two", "cache_aware", "round_robin")
ENGINES = ("e0", "e1", "e2", "e3")


def start_engines(
    model: str, cell: Cell, speedup: float
) -> list[tuple[subprocess.Popen[str], str]]:
    """Four fresh engines, started side by side (each start is mostly Python's imports)."""
    flags = model_flags(model, cell, speedup)
    with concurrent.futures.ThreadPoolExecutor(len(ENGINES)) as pool:
        futures = [pool.submit(start_vllm_engine, name, flags) for name in ENGINES]
        started, errors = [], []
        for f in futures:
            try:
                started.append(f.result())
            except RuntimeError as exc:
                errors.append(exc)
    if errors:
        stop_processes([p for p, _url in started])
        raise errors[0]
    return started


def kvroute_config(urls: Sequence[str]) -> dict[str, Any]:
    """kvroute as a user first deploys it in front of vLLM: the backends and their kind."""
    backends = [
        {"name": name, "url": url, "kind": "vllm"} for name, url in zip(ENGINES, urls, strict=True)
    ]
    return {"listen": {"host": "127.0.0.1", "port": free_port()}, "backends": backends}


def hold_figures(url: str) -> dict[str, float]:
    """kvroute's own account of holding requests: its queue wait and its backend hand-offs."""
    text = httpx.get(url + "/metrics", timeout=5).text
    wanted = {
        "kvroute_queue_wait_seconds_count": "queue_wait_count",
        "kvroute_queue_wait_seconds_sum": "queue_wait_s",
        "kvroute_queued_at_backend_total": "queued_at_backend",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
    return out


def run_router(
    router: str, model: str, cell: Cell, requests: list[Request], args: argparse.Namespace
) -> dict[str, Any]:
    """One router over fresh engines: the same requests at the same times, every client streaming."""
    procs: list[subprocess.Popen[str]] = []
    try:
        engines = start_engines(model, cell, args.speedup)
        procs += [p for p, _url in engines]
        urls = [url for _p, url in engines]
        with tempfile.TemporaryDirectory() as tmp:
            if router == "kvroute":
                gw, gw_url = start_gateway(kvroute_config(urls), Path(tmp))
            else:
                workers = ["--worker-urls", *urls]
                gw, gw_url = start_vllm_router(args.vllm_router_exe, router, workers, Path(tmp))
            procs.append(gw)
            started = time.monotonic()
            samples = asyncio.run(q.drive(gw_url, requests, args.seed))
            outcome = q.PolicyRun(router, samples, wall_s=time.monotonic() - started)
            outcome.preemptions = int(sum(counter(u, "vllm:num_preemptions") for u in urls))
            # How evenly the router spread the prompt work (recomputes included).
            spread = [int(counter(u, "vllm:prompt_tokens")) for u in urls]
            row = outcome.summary()
            row["ttft_p99"] = all_p99(samples)
            row["goodput"] = row.pop("output_tokens_per_s")
            row.pop("handed_to_queue")
            row["engine_prompt_tokens"] = spread
            if router == "kvroute":
                row |= hold_figures(gw_url)
                row["longest_hold_s"] = longest_hold(samples)
        return row
    finally:
        stop_processes(procs)


def longest_hold(samples: Sequence[q.Sample]) -> float:
    """The longest hold at the gateway, from the answers' ``Server-Timing: hold`` (seconds)."""
    held = [0.0]
    for s in samples:
        for part in s.timing.split(","):
            name, _, dur = part.strip().partition(";dur=")
            if name == "hold" and dur:
                held.append(float(dur) / 1000)
    return max(held)


def all_p99(samples: Sequence[q.Sample]) -> float | None:
    xs = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None


def available_routers(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The routers that can run, and a line for each that cannot."""
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown router(s) {unknown}; choose from {', '.join(ROUTERS)}")
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    if args.vllm_router_exe is not None:
        return routers, []
    reason = (
        "not installed (no `vllm-router` on PATH nor in /tmp/vllm-router-venv; python -m venv "
        "/tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router)"
    )
    skipped = [f"vllm-router {r} skipped: {reason}" for r in routers if r != "kvroute"]
    return [r for r in routers if r == "kvroute"], skipped


def run_grid(
    args: argparse.Namespace, routers: list[str], skipped: list[str]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in args.engine_models.split(","):
        for name in args.cells.split(","):
            cell = CELLS[name]
            for run in range(1, args.runs + 1):
                requests = workload(cell, args.duration, args.speedup, args.seed + run)
                for router in routers:
                    try:
                        row = run_router(router, model, cell, requests, args)
                    except RuntimeError as exc:
                        if router == "kvroute":
                            raise
                        # A peer that would not start loses its row, not the whole grid.
                        skipped.append(f"{model}/{name} run {run} {router} skipped: {exc}")
                        print(skipped[-1], flush=True)
                        continue
                    row |= {"model": model, "cell": name, "run": run, "router": router}
                    rows.append(row)
                    print(progress_line(row), flush=True)
    return rows


def progress_line(r: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (
        f"{r['model']}/{r['cell']} run {r['run']} {r['router']}: failed {r['failed']}/"
        f"{r['requests']}, short TTFT p50 {f(r['short_ttft_p50'])} p99 {f(r['short_ttft_p99'])}, "
        f"long p50 {f(r['long_ttft_p50'])} p99 {f(r['long_ttft_p99'])}, preemptions "
        f"{r['preemptions']}, goodput {r['goodput']:.0f} tok/s, prompt tokens per engine "
        f"{r['engine_prompt_tokens']}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench do-no-harm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"of {', '.join(CELLS)}")
    p.add_argument("--engine-models", "--engines-models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=3, help="runs per cell; verdicts on medians")
    p.add_argument("--duration", type=float, default=20.0, help="wall seconds of arrivals")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--speedup", type=float, default=10.0, help="engines' simulated time / wall")
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--vllm-router", default=None, help="path of vllm-router (default: PATH, venv)")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [c for c in args.cells.split(",") if c not in CELLS]
    bad += [m for m in args.engine_models.split(",") if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown cell(s) or engine model(s): {bad}")
    routers, skipped = available_routers(args)
    for line in skipped:
        print(line, flush=True)
    rows = run_grid(args, routers, skipped)
    cells = summarise(rows)
    results = verdicts(cells, {name: CELLS[name] for name in args.cells.split(",")})
    table(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
        out["skipped"] = skipped
        out |= {"runs": rows, "cells": results}
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
