"""KV-cache events against the approximate index: the document workload under disturbances.

Four simulated vLLM engines (``--behaviour vllm --serial-prefill``, prefix cache) publish
KV-cache events as vLLM 0.28 does (``--kv-events-config``; ``--encoding``) and answer vLLM's
render API; the shared-document workload (``loadtest.bench.prefix``: documents of 15-30k
tokens, Zipf popularity, and short chats) runs through each target, one fresh fleet per row.
The engines' KV cache is sized from the run: the fleet holds ``--cache-share`` (0.8) of the
documents the run asks about, so engines evict (a fleet that holds every document tells
events and guesses apart only by luck). Five scenarios:

* ``plain``: every request through the router;
* ``restart``: engine e1's process is restarted half way through (its cache is empty after);
* ``reset``: engine e1's prefix cache is reset half way through (vLLM's
  ``/reset_prefix_cache``: ``AllBlocksCleared``, same process, same start time);
* ``bypass``: 30% of requests go straight to a random engine, past the router (another
  client filling caches the router never saw);
* ``replicas``: two router processes, requests alternating between them (kvroute: one Redis
  store, placements shared; vllm-router: two independent routers).

Targets: kvroute with events (``backends[].kv_events``, ``routing.prefix.chat_render`` set to
the engine's template), kvroute approximate (the same without events), vllm-router
``cache_aware`` and, where it starts, ``kv_aware`` fed the same event sources
(``--kv-event-source URL=tcp://...``). Measured: the engines' prefix-cache hit rate (all
requests), and the time to first token of the documents' requests sent through the router
(p50, p99), failed requests.

    python -m loadtest.bench.kv_events --quick            # 120 requests a row
    python -m loadtest.bench.kv_events --scenarios plain,bypass --json out/kv_events.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.kv_events_measure import (
    Ceiling,
    Row,
    ceiling,
    drive,
    fill,
    ratios,
    request_urls,
    table,
)
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.bench.prefix import bodies, scrape, wait_reported, wait_serving
from loadtest.local_fleet import EngineSpec, LocalFleet, Proc, free_port, wait_http
from loadtest.workload import SharedDocs, shared_documents

SCENARIOS = ("plain", "restart", "reset", "bypass", "replicas")
TARGETS = (
    "kvroute + events",
    "kvroute approximate",
    "vllm-router cache_aware",
    "vllm-router kv_aware",
)
ENGINES = 4
#: The engines' KV block (``EngineSpec``'s default; vllm-router's ``--kv-event-block-size``).
BLOCK_SIZE = 16
#: Per engine: the largest document (30k tokens) with its questions and answer must fit.
MIN_CAPACITY = 40_000


def free_port_pair() -> int:
    """A base port with base+1 free too (the engine's PUB and replay ROUTER)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base: int = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no free port pair")


def events_flag(base: int, encoding: str = "batch_array") -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{base}",
            "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
            "encoding": encoding,
        }
    )


def make_fleet(args: Any, ports: list[int], redis: bool) -> LocalFleet:
    specs = [
        EngineSpec(
            f"e{i}",
            "general",
            "contiguous",
            args.capacity,
            args.speedup,
            16,
            (
                "--behaviour",
                "vllm",
                "--serial-prefill",
                "--kv-events-config",
                events_flag(p, args.encoding),
            ),
        )
        for i, p in enumerate(ports)
    ]
    overrides: dict[str, Any] = {
        "queue": {"max_wait_s": 20.0},
        "upstream": {"total_timeout_s": 120.0},
    }
    return LocalFleet(specs, use_redis=redis, config_overrides=overrides)


def kvroute_backends(fleet: LocalFleet, ports: list[int], events: bool) -> list[dict[str, Any]]:
    out = []
    for spec, proc, base in zip(fleet.specs, fleet.engines, ports, strict=True):
        b: dict[str, Any] = {"name": spec.name, "url": proc.url, "kind": "vllm"}
        if events:
            b["kv_events"] = {
                "endpoint": f"tcp://127.0.0.1:{base}",
                "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
            }
        out.append(b)
    return out


def start_kvroute(
    fleet: LocalFleet, ports: list[int], events: bool, replicas: int, ttft_slack: float = 0.25
) -> list[Proc]:
    fleet.config_overrides["backends"] = kvroute_backends(fleet, ports, events)
    prefix: dict[str, Any] = {"chat_render": {}, "events": {"enabled": events}}
    # A negative slack: the expected-TTFT rule off, its default (docs/expected-ttft.md).
    if ttft_slack >= 0:
        prefix.update({"ttft_aware": True, "ttft_slack": ttft_slack})
    fleet.config_overrides["routing"] = {"prefix": prefix}
    procs = [fleet.start_gateway("kvroute")]
    for i in range(1, replicas):
        port = free_port()
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--config"]
        argv += [str(fleet.workdir / "kvroute-kvroute.yaml"), "--port", str(port)]
        extra = Proc(
            f"gateway-{i + 1}", [*argv, "--log-level", "warning"], f"http://127.0.0.1:{port}"
        )
        extra.start(log_dir=fleet.workdir)
        wait_http(extra.url + "/health", proc=extra.popen)
        procs.append(extra)
    for p in procs:
        wait_reported(p.url)
    return procs


def start_router(exe: str, policy: str, fleet: LocalFleet, ports: list[int]) -> Proc:
    port = free_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--log-level", "warning", "--worker-urls", *(p.url for p in fleet.engines)]
    if policy == "kv_aware":
        for proc, base in zip(fleet.engines, ports, strict=True):
            argv += ["--kv-event-source", f"{proc.url}=tcp://127.0.0.1:{base}"]
            argv += ["--kv-event-replay-source", f"{proc.url}=tcp://127.0.0.1:{base + 1}"]
        argv += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "sim-model"]
    proc = Proc(f"vllm-router-{port}", argv, f"http://127.0.0.1:{port}")
    proc.start(log_dir=fleet.workdir)
    wait_serving(proc.url, proc, timeout_s=30.0)
    return proc


def reset_of(proc: Proc) -> Any:
    """vLLM's ``POST /reset_prefix_cache``: the cache emptied, the process (and start time) kept."""

    def reset() -> None:
        httpx.post(proc.url + "/reset_prefix_cache", timeout=10.0).raise_for_status()

    return reset


def restart_of(proc: Proc, fleet: LocalFleet) -> Any:
    def restart() -> None:
        proc.stop()
        proc.start(log_dir=fleet.workdir)
        wait_http(proc.url + "/health", proc=proc.popen)

    return restart


def one_row(
    scenario: str, target: str, w: SharedDocs, payloads: list[dict[str, Any]], args: Any
) -> Row:
    row = Row(scenario, target)
    exe = find_vllm_router(None) if target.startswith("vllm-router") else None
    if target.startswith("vllm-router") and exe is None:
        row.note = "vllm-router not installed"
        return row
    ports = [free_port_pair() for _ in range(ENGINES)]
    replicas = 2 if scenario == "replicas" else 1
    fleet = make_fleet(args, ports, redis=replicas > 1 and exe is None)
    routers: list[Proc] = []
    try:
        if fleet.use_redis:
            fleet.start_redis()
        fleet.start_engines()
        if exe is None:
            events = target == "kvroute + events"
            routers = start_kvroute(fleet, ports, events, replicas, args.ttft_slack)
        else:
            policy = target.rpartition(" ")[2]
            for _ in range(replicas):
                routers.append(start_router(exe, policy, fleet, ports))
        urls = request_urls(
            scenario,
            [r.url for r in routers],
            [p.url for p in fleet.engines],
            len(payloads),
            args.seed,
        )
        restart = None
        if scenario == "restart":
            restart = restart_of(fleet.engines[1], fleet)
        elif scenario == "reset":
            restart = reset_of(fleet.engines[1])
        before = [scrape(p.url) for p in fleet.engines]
        results = asyncio.run(drive(urls, w, payloads, restart))
        after = [scrape(p.url) for p in fleet.engines]
    except (RuntimeError, TimeoutError) as e:
        row.note = f"did not start: {e}"
        return row
    finally:
        for r in routers:
            if r is not fleet.gateway:
                r.stop()
        fleet.stop()
    fill(row, results, before, after, scenario)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.kv_events", description=__doc__)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=16.0, help="requests per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="KV tokens per engine (default: --cache-share of the documents the run asks about)",
    )
    p.add_argument(
        "--cache-share",
        type=float,
        default=0.8,
        help="the fleet's KV cache as a share of the run's document working set",
    )
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="120 requests a row")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--targets", default="", help="comma-separated substrings of target names")
    p.add_argument(
        "--ttft-slack",
        type=float,
        default=-1.0,
        help="kvroute: routing.prefix.ttft_aware on with this ttft_slack; negative (the "
        "default): the rule off",
    )
    p.add_argument(
        "--encoding",
        choices=("batch_array", "array", "map"),
        default="batch_array",
        help="the engines' event layout: batch_array (vLLM 0.28: the one vllm-router 0.1.17 "
        "decodes), array (older vLLM) or map (newer vLLM)",
    )
    p.add_argument("--runs", type=int, default=1, help="every row this many times, in turn")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    n = 120 if args.quick else args.requests
    w = shared_documents(n, args.rate, seed=args.seed)
    payloads = bodies(w)
    for body in payloads:
        # The final chunk then carries the prompt's cached tokens (hit rate of routed requests).
        body["stream_options"] = {"include_usage": True}
    working_set = sum(w.doc_tokens[d] for d in {t.doc for t in w.turns if t.doc is not None})
    if not args.capacity:
        args.capacity = max(MIN_CAPACITY, int(args.cache_share * working_set / ENGINES))
    print(
        f"documents asked about: {working_set} tokens; fleet KV cache: "
        f"{ENGINES * args.capacity} tokens ({ENGINES} x {args.capacity})",
        flush=True,
    )
    targets = [
        t for t in TARGETS if not args.targets or any(k in t for k in args.targets.split(","))
    ]
    rows: list[Row] = []
    ceilings: dict[str, Ceiling] = {}
    for scenario in args.scenarios.split(","):
        urls = request_urls(scenario, ["router"], ["engine"], len(payloads), args.seed)
        most = ceiling(payloads, [not u.startswith("direct:") for u in urls], BLOCK_SIZE)
        ceilings[scenario] = most
        print(
            f"{scenario}: ceiling {most.all:.1%} of all prompt tokens, {most.routed:.1%} of "
            "routed ones (every block sent before still cached)",
            flush=True,
        )
    for run in range(1, args.runs + 1):
        for scenario, most in ceilings.items():
            for target in targets:
                row = one_row(scenario, target, w, payloads, args)
                if row.note.startswith("did not start"):
                    # Ports are picked free, then bound by the engines: another process on
                    # the box may take one in between. A fresh fleet, fresh ports.
                    row = one_row(scenario, target, w, payloads, args)
                row.run, row.ceiling, row.routed_ceiling = run, most.all, most.routed
                print(json.dumps(row.__dict__), flush=True)
                rows.append(row)
    print(table(rows))
    print(ratios(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
