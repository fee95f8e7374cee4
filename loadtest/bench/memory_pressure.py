"""Memory pressure on paged engines: preemptions, goodput and TTFT, kvroute against its peers.

Four vLLM-mode engines (``kvroute engine --behaviour vllm``: paged 16-token blocks allocated
lazily, a FIFO waiting queue, preemption with recompute, ``vllm:num_preemptions_total``),
the fleet of ``loadtest.bench.queueing`` (two data-parallel 2 in the general pool, two single
engines in a ``long`` pool), with little KV for the work: what fails here is not admission
but decode growth. Workloads (``loadtest.bench.memory_pressure_workloads``): a bimodal mix
of chats and documents at two loads, the shipped trace with long outputs, and the trace at
the scale users first reported (``trace-x4``).

For each workload and router: fresh engines, then the router, then the same request list
(same seed, same arrival times), every client streaming. Reported: failed requests,
preemptions (the engines' own counter), goodput (output tokens of completed requests per
second of the run), time to first token p99 for short and long requests, and preemptions
over time (sampled every 0.5 s; ``--plot``).

    python -m loadtest.bench memory-pressure --quick --json out/mp.json --plot docs/img/memory-pressure.png
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import goodput
from loadtest.bench import queueing as q
from loadtest.bench.engine_fleet import (
    DECODE_TOKENS_PER_S,
    counter,
    start_gateway,
    start_vllm_router,
)
from loadtest.bench.memory_pressure_report import plot, report, table
from loadtest.bench.memory_pressure_trace import record, rises
from loadtest.bench.memory_pressure_workloads import (
    WORKLOADS,
    Workload,
    add_options,
    bodies,
    workload,
)
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.children import stop_processes

POLICIES = ("kvroute", "round_robin", "least_loaded")
PEERS = ("vllm-router:power_of_two", "vllm-router:cache_aware")


@dataclass
class Outcome:
    policy: str
    samples: list[q.Sample]
    outputs: list[int]  # each request's real output length, in request order
    wall_s: float
    preemptions: int
    timeline: list[tuple[float, int]] = field(default_factory=list)
    # The earliest any router could answer the last token, and the request that sets it
    # (loadtest.bench.goodput.floor).
    floor_s: float = 0.0
    critical: int = 0
    # kvroute only: held requests it handed to a backend's queue (``kvroute_queued_at_backend``).
    handed: int = 0

    def summary(self) -> dict[str, Any]:
        run = q.PolicyRun(self.policy, self.samples, self.preemptions, wall_s=self.wall_s)
        finishes = [
            goodput.Finish(s.sent_s + s.total_s, out)
            for s, out in zip(self.samples, self.outputs, strict=True)
            if s.status == 200 and s.ttft_s is not None and s.total_s is not None
        ]
        done = [f.tokens for f in finishes]
        floor_s = max(self.floor_s, 1e-9)
        return {
            "policy": self.policy,
            "requests": len(self.samples),
            "failed": len(self.samples) - len(done),
            "preemptions": self.preemptions,
            "goodput_tokens_per_s": sum(done) / max(self.wall_s, 1e-9),
            "short_ttft_p99": run.pct("short", 0.99),
            "long_ttft_p99": run.pct("long", 0.99),
            "short_ttft_p50": run.pct("short", 0.5),
            "long_ttft_p50": run.pct("long", 0.5),
            "floor_s": self.floor_s,
            "goodput_ceiling": sum(self.outputs) / floor_s,
            "mean_end_s": goodput.mean_end(finishes),
            "last_ttft_s": self.samples[self.critical].ttft_s,
            "handed_to_queue": self.handed,
        }


async def sample_preemptions(
    urls: list[str], t0: float, stop: asyncio.Event, into: list[tuple[float, int]]
) -> None:
    """The fleet's preemption counter every 0.5 s, until ``stop``."""
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            total = 0
            for url in urls:
                try:
                    text = (await client.get(url + "/metrics")).text
                except httpx.HTTPError:
                    continue
                total += int(
                    sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in text.splitlines()
                        if line.startswith("vllm:num_preemptions_total")
                    )
                )
            into.append((time.monotonic() - t0, total))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def drive(
    url: str,
    engines: dict[str, str],
    w: Workload,
    payloads: list[dict[str, Any]],
    debug: Path | None = None,
) -> tuple[list[q.Sample], list[tuple[float, int]], float]:
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    timeline: list[tuple[float, int]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.monotonic()
        engine_urls = list(engines.values())
        sampler = asyncio.create_task(sample_preemptions(engine_urls, start, stop, timeline))
        tracer = asyncio.create_task(
            record(url, engines, start, stop, debug) if debug is not None else stop.wait()
        )
        tasks: list[asyncio.Task[q.Sample]] = []
        for req, body in zip(w.requests, payloads, strict=True):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.monotonic()
            tasks.append(
                asyncio.create_task(q.one(client, url + "/v1/chat/completions", req, body, t0))
            )
        samples = list(await asyncio.gather(*tasks))
        wall = time.monotonic() - start
        stop.set()
        await sampler
        await tracer
    return samples, timeline, wall


def run_policy(policy: str, w: Workload, args: argparse.Namespace, seed: int) -> Outcome:
    engine_args = copy.copy(args)
    engine_args.capacity = w.capacity
    engine_args.long_min = w.long_min
    engine_args.long_threshold = w.long_threshold
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = start_engines(engine_args, procs)
        with tempfile.TemporaryDirectory() as tmp:
            peer = policy.partition("vllm-router:")[2]
            if peer:
                workers = ["--worker-urls", *urls.values()]
                gw, gw_url = start_vllm_router(args.vllm_router_exe, peer, workers, Path(tmp))
            else:
                gw, gw_url = start_gateway(q.gateway_config(policy, urls, engine_args), Path(tmp))
            procs.append(gw)
            debug = None
            if args.debug_trace is not None:
                debug = args.debug_trace / f"{w.name}-{seed}-{policy.replace(':', '-')}.jsonl"
            samples, timeline, wall = asyncio.run(drive(gw_url, urls, w, bodies(w, seed), debug))
            if debug is not None:
                print("\n".join(rises(debug)), flush=True)
            total = int(sum(counter(u, "vllm:num_preemptions") for u in urls.values()))
            handed = 0 if peer else int(counter(gw_url, "kvroute_queued_at_backend"))
        outputs = [r.output_tokens for r in w.requests]
        floor_s, critical = goodput.floor(
            w.requests, args.prefill * args.speedup, DECODE_TOKENS_PER_S * args.speedup
        )
        return Outcome(policy, samples, outputs, wall, total, timeline, floor_s, critical, handed)
    finally:
        stop_processes(procs)


def start_engines(args: argparse.Namespace, procs: list[subprocess.Popen[str]]) -> dict[str, str]:
    """The fleet's engines, started together (each start is mostly Python importing: one
    after the other they took most of a row's time on the loaded box). Every engine that
    started is in ``procs``, also when another did not (the caller stops them)."""
    with concurrent.futures.ThreadPoolExecutor(len(q.FLEET)) as pool:
        started = {name: pool.submit(q.start_engine, name, dp, args) for name, dp, _pool in q.FLEET}
    urls: dict[str, str] = {}
    failure: RuntimeError | None = None
    for name, future in started.items():
        try:
            proc, urls[name] = future.result()
        except RuntimeError as exc:
            failure = exc
            continue
        procs.append(proc)
    if failure is not None:
        raise failure
    return urls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench memory-pressure", description=__doc__
    )
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--first-run", type=int, default=1, help="number of the first run (seed + run)")
    p.add_argument("--quick", action="store_true", help="one run, 12 s of arrivals")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES + PEERS))
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--speedup", type=float, default=4.0, help="engines' time acceleration")
    add_options(p)
    p.add_argument("--prefill", type=float, default=2_500.0, help="prefill tokens/s per engine")
    p.add_argument("--max-num-seqs", type=int, default=32, help="running requests per engine")
    p.add_argument("--vllm-router", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument(
        "--debug-trace",
        type=Path,
        default=None,
        help="folder: each engine's state and kvroute's projection every 0.25 s, printed at each preemption",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.runs, args.duration = 1, min(args.duration, 12.0)
    policies = args.policies.split(",")
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    if args.vllm_router_exe is None:
        print("vllm-router skipped: not installed (see loadtest.bench.queueing)", flush=True)
        policies = [p for p in policies if not p.startswith("vllm-router:")]
    rows: list[dict[str, Any]] = []
    outcomes: list[tuple[str, int, Outcome]] = []
    for run in range(args.first_run, args.first_run + args.runs):
        for wl in args.workloads.split(","):
            w = workload(wl, args, args.seed + run)
            for policy in policies:
                try:
                    o = run_policy(policy, w, args, args.seed + run)
                except RuntimeError as exc:
                    print(f"| {wl} | {run} | {policy} | skipped: {exc} |", flush=True)
                    continue
                res = {"workload": wl, "run": run, **o.summary()}
                res["timeline"] = o.timeline
                rows.append(res)
                outcomes.append((wl, run, o))
                print(table([res]).splitlines()[-1], flush=True)
        # Written after every run: a long session stopped early keeps what it measured.
        save(rows, outcomes, args)
    print(report(rows))
    return 0


def save(
    rows: list[dict[str, Any]], outcomes: list[tuple[str, int, Outcome]], args: argparse.Namespace
) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot is not None and outcomes:
        plot(outcomes, args.plot)


if __name__ == "__main__":
    raise SystemExit(main())
