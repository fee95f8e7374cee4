"""Queueing backends near saturation: kvroute vs round robin vs least loaded, streaming clients.

A reduced form of the "vLLM, exactly" / "Queueing backends" benchmark that fits a shared
2-core machine: four vLLM-mode engines (``kvroute engine --behaviour vllm``: paged blocks
allocated lazily, a FIFO waiting queue instead of errors, preemption with recompute), two of
them data-parallel 2, two in a ``long`` pool; the bimodal mix (70% short chats, 30% long
documents, lengths scaled down) sent open-loop near the fleet's prefill capacity, every client
streaming. For each policy the engines are started fresh, then the gateway (a process, as
deployed), then the same request list (same seed, same arrival times).

Reported per policy: failed requests, time to first token (first streamed content) p50/p99
for short and for long requests, preemptions (the engines' own ``vllm:num_preemptions_total``),
requests the gateway handed to a backend's queue, and throughput (output tokens per second).

vllm-router (the Rust router; PyPI ships a prebuilt wheel, ``python -m venv
/tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router``; never a
dependency of kvroute) joins the comparison with ``round_robin``, ``power_of_two`` and
``cache_aware`` when found on PATH or in /tmp/vllm-router-venv; otherwise those rows are
skipped with the reason printed. It sees the four engines as four equal workers (it has no
pools). Its ``power_of_two`` polls each worker's ``/get_load`` (SGLang's endpoint) every 5 s;
vLLM and the simulated engines answer 404 there, so it compares its own in-flight request
counts per worker (checked with its ``--log-level info`` selection lines).

    python -m loadtest.bench.queueing --runs 1 --duration 15 --rate 8 --json out/q.json \\
        --plot docs/img/queueing.png
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.engine_fleet import (
    DECODE_TOKENS_PER_S,
    counter,
    engine_flags,
    start_gateway,
    start_vllm_engine,
    start_vllm_router,
)
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.children import stop_processes
from loadtest.local_fleet import free_port
from loadtest.workload import Request, bimodal, chat_overhead_tokens, make_prompt

POLICIES = ("kvroute", "round_robin", "least_loaded")
PEERS = ("vllm-router:round_robin", "vllm-router:power_of_two", "vllm-router:cache_aware")
# name, data-parallel engines, pool
FLEET = (("e0", 1, "long"), ("e1", 1, "long"), ("e2", 2, "general"), ("e3", 2, "general"))


@dataclass
class Sample:
    kind: str
    status: int
    ttft_s: float | None
    tokens: int
    backend: str = ""
    sent_s: float = 0.0  # since the first arrival (for per-request diagnosis: --raw)
    # The gateway's ``Server-Timing`` header (where a two-step request's time went), if any.
    timing: str = ""
    # Until the last token; the longest wait between two tokens (a preemption's stall shows here).
    total_s: float | None = None
    max_gap_s: float = 0.0


@dataclass
class PolicyRun:
    policy: str
    samples: list[Sample] = field(default_factory=list)
    preemptions: int = 0
    handed_to_queue: int = 0
    wall_s: float = 0.0

    def pct(self, kind: str, q: float) -> float | None:
        xs = sorted(s.ttft_s for s in self.samples if s.kind == kind and s.ttft_s is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    def summary(self) -> dict[str, Any]:
        failed = sum(1 for s in self.samples if s.status != 200 or s.ttft_s is None)
        return {
            "policy": self.policy,
            "requests": len(self.samples),
            "failed": failed,
            "short_ttft_p50": self.pct("short", 0.5),
            "short_ttft_p99": self.pct("short", 0.99),
            "long_ttft_p50": self.pct("long", 0.5),
            "long_ttft_p99": self.pct("long", 0.99),
            "preemptions": self.preemptions,
            "handed_to_queue": self.handed_to_queue,
            "output_tokens_per_s": sum(s.tokens for s in self.samples) / max(self.wall_s, 1e-9),
        }


def start_engine(name: str, dp: int, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    flags = engine_flags(
        args.capacity * dp,
        args.prefill,
        args.speedup,
        args.max_num_seqs,
        *("--data-parallel", str(dp), "--chunk-interval-s", "0.1"),
    )
    return start_vllm_engine(name, flags)


def long_threshold(args: argparse.Namespace) -> int:
    """The gateway's long threshold, in tokens of demand (prompt + ``max_tokens``).

    ``args.long_threshold`` where a workload sets it, else half the smallest long prompt
    (this benchmark's clients send a small ``max_tokens``).
    """
    return int(getattr(args, "long_threshold", None) or args.long_min // 2)


def gateway_config(policy: str, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    rate = args.prefill * args.speedup
    backends = [
        {
            "name": name,
            "url": urls[name],
            "kind": "vllm",
            "pool": pool,
            "prefill_tokens_per_s": rate,
            "decode_tokens_per_s": DECODE_TOKENS_PER_S * args.speedup,
        }
        for name, _dp, pool in FLEET
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "backends": backends,
        "pools": {"general": {"role": "general"}, "long": {"role": "long"}},
        "routing": {"policy": policy, "long_threshold_tokens": long_threshold(args)},
        "collector": {"scrape_interval_s": 0.25, "stale_after_s": 5.0},
        "health": {"active": {"enabled": False}},
    }


async def one(
    client: httpx.AsyncClient, url: str, req: Request, body: dict[str, Any], t0: float
) -> Sample:
    sample = await _one(client, url, req, body, t0)
    sample.sent_s = req.arrival_s
    return sample


async def _one(
    client: httpx.AsyncClient, url: str, req: Request, body: dict[str, Any], t0: float
) -> Sample:
    ttft: float | None = None
    tokens = 0
    last = gap = 0.0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Sample(req.kind, resp.status_code, None, 0)
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content"' in line:
                    now = time.monotonic()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gap = max(gap, now - last)
                    last = now
                    tokens += 1
            backend = resp.headers.get("x-kvroute-backend", "")
            timing = resp.headers.get("server-timing", "")
            total = time.monotonic() - t0
            return Sample(
                req.kind, 200, ttft, tokens, backend, timing=timing, total_s=total, max_gap_s=gap
            )
    except httpx.HTTPError:
        return Sample(req.kind, 0, None, tokens)


async def drive(
    url: str, requests: list[Request], seed: int, bodies: list[dict[str, Any]] | None = None
) -> list[Sample]:
    """Send ``requests`` open loop at their arrival times (``bodies``: made from them if None)."""
    if bodies is None:
        rng = random.Random(seed)
        overhead = chat_overhead_tokens()
        bodies = [
            {
                "model": "sim-model",
                "messages": [
                    {
                        "role": "user",
                        "content": make_prompt(max(1, r.prompt_tokens - overhead), rng),
                    }
                ],
                "max_tokens": max(1, r.output_tokens),
                "stream": True,
            }
            for r in requests
        ]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.monotonic()
        tasks: list[asyncio.Task[Sample]] = []
        for req, body in zip(requests, bodies, strict=True):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.monotonic()
            tasks.append(
                asyncio.create_task(one(client, url + "/v1/chat/completions", req, body, t0))
            )
        return list(await asyncio.gather(*tasks))


def run_policy(policy: str, requests: list[Request], args: argparse.Namespace) -> PolicyRun:
    procs: list[subprocess.Popen[str]] = []
    try:
        urls: dict[str, str] = {}
        for name, dp, _pool in FLEET:
            proc, url = start_engine(name, dp, args)
            procs.append(proc)
            urls[name] = url
        with tempfile.TemporaryDirectory() as tmp:
            peer = policy.partition("vllm-router:")[2]
            if peer:
                assert args.vllm_router_exe is not None
                workers = ["--worker-urls", *urls.values()]
                gw, gw_url = start_vllm_router(args.vllm_router_exe, peer, workers, Path(tmp))
            else:
                gw, gw_url = start_gateway(gateway_config(policy, urls, args), Path(tmp))
            procs.append(gw)
            started = time.monotonic()
            samples = asyncio.run(drive(gw_url, requests, args.seed))
            run = PolicyRun(policy, samples, wall_s=time.monotonic() - started)
            run.preemptions = int(sum(counter(u, "vllm:num_preemptions") for u in urls.values()))
            if not peer:
                run.handed_to_queue = int(counter(gw_url, "kvroute_queued_at_backend"))
        return run
    finally:
        stop_processes(procs)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | policy | failed | short TTFT p50 / p99 (s) | long TTFT p50 / p99 (s) "
        "| preemptions | handed to a backend queue | output tok/s |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['run']} | {r['policy']} | {r['failed']}/{r['requests']} "
        f"| {fmt(r['short_ttft_p50'])} / {fmt(r['short_ttft_p99'])} "
        f"| {fmt(r['long_ttft_p50'])} / {fmt(r['long_ttft_p99'])} "
        f"| {r['preemptions']} | {r['handed_to_queue']} | {r['output_tokens_per_s']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5))
    for ax, kind in zip(axes, ("short", "long"), strict=True):
        for i, policy in enumerate(policies):
            mine = [r for r in rows if r["policy"] == policy]
            p99 = [r[f"{kind}_ttft_p99"] or 0.0 for r in mine]
            p50 = [r[f"{kind}_ttft_p50"] or 0.0 for r in mine]
            xs = [i + 0.16 * j for j in range(len(mine))]
            ax.bar(xs, p99, width=0.14)
            ax.scatter(xs, p50, color="black", s=10, zorder=3)
        ax.set_xticks([i + 0.32 for i in range(len(policies))], policies, fontsize=8)
        ax.set_title(f"{kind} requests: TTFT p99 (bars), p50 (dots)")
        ax.set_ylabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.queueing", description=__doc__)
    p.add_argument("--runs", type=int, default=1, help="repetitions of the whole comparison")
    p.add_argument("--first-run", type=int, default=1, help="number of the first run (seed + run)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per policy")
    p.add_argument("--rate", type=float, default=11.0, help="arrivals per second")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--capacity", type=int, default=24_000, help="KV tokens per engine")
    p.add_argument("--prefill", type=float, default=2_500.0, help="prefill tokens/s per engine")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=8, help="running requests per engine")
    p.add_argument("--long-min", type=int, default=3_000, help="long prompts: min tokens")
    p.add_argument("--long-max", type=int, default=6_000, help="long prompts: max tokens")
    p.add_argument("--policies", default=",".join(POLICIES + PEERS))
    p.add_argument("--vllm-router", default=None, help="path of vllm-router (default: PATH, venv)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--raw", type=Path, default=None, help="folder for per-request samples")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = args.policies.split(",")
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    if args.vllm_router_exe is None and any(p.startswith("vllm-router:") for p in policies):
        print(
            "vllm-router skipped: not installed (no `vllm-router` on PATH nor in "
            "/tmp/vllm-router-venv; python -m venv /tmp/vllm-router-venv && "
            "/tmp/vllm-router-venv/bin/pip install vllm-router)",
            flush=True,
        )
        policies = [p for p in policies if not p.startswith("vllm-router:")]
    rows: list[dict[str, Any]] = []
    for run in range(args.first_run, args.first_run + args.runs):
        requests = bimodal(
            args.rate,
            duration_s=args.duration,
            seed=args.seed + run,
            short=(20, 300),
            long=(args.long_min, args.long_max),
            short_output=(16, 128),
            long_output=(32, 256),
        )
        for policy in policies:
            try:
                outcome = run_policy(policy, requests, args)
            except RuntimeError as exc:
                if not policy.startswith("vllm-router:"):
                    raise
                # A peer that would not start loses its row, not the whole comparison.
                print(f"| {run} | {policy} | skipped: {exc} |", flush=True)
                continue
            res = outcome.summary()
            res["run"] = run
            if args.raw is not None:
                args.raw.mkdir(parents=True, exist_ok=True)
                name = f"run{run}-{policy.replace(':', '-')}.json"
                raw = [dataclasses.asdict(s) for s in outcome.samples]
                (args.raw / name).write_text(json.dumps(raw))
            rows.append(res)
            print(table([res]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
