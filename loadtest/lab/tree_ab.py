"""A/B two checkouts of kvroute over HTTP: the same backends, wrk rounds alternating.

    python -m loadtest.lab ab /path/to/before /path/to/after [--rounds 6] [--stream]

How every change of issue 12 ("Fast") was judged. Each tree's gateway is its own
``kvroute serve`` importing from that tree first (``in_tree``), both behind the same two
trivial backends (and, with ``--redis``, the same redis-server). Rounds run A, B, B, A, ...
so drift in the box's load falls on both; each round prints requests/s and the gateway's
CPU microseconds per request (from ``/proc``, threads included), and the summary is the
median of the per-round-pair ratios B/A. On a shared 2-core machine absolute rates swing by 2x between
runs; only ratios measured side by side mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from loadtest.bench.overhead_load import (
    CHAT_PATH,
    cpu_seconds,
    find_wrk,
    request_body,
    run_wrk,
)
from loadtest.bench.overhead_targets import wait_post_ok
from loadtest.local_fleet import EngineSpec, Proc, free_port, gateway_config, redis_proc, wait_http


def _tree_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = str(tree)
    return env


def in_tree(tree: Path, module: str, *args: str) -> list[str]:
    """``python -m module args`` with ``tree``'s code first on ``sys.path``, wherever it runs.

    ``python -m`` puts the working directory before ``PYTHONPATH``: started from inside a
    checkout, both gateways ran that checkout's code and the A/B compared a tree with itself
    (found when two builds 15% apart on tiny requests measured x1.00 here).
    """
    boot = (
        f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", boot, *args]


def _rounds(n: int) -> list[str]:
    """A,B then B,A, alternating, so neither side always runs first."""
    out: list[str] = []
    for r in range(n):
        out += ["A", "B"] if r % 2 == 0 else ["B", "A"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.lab ab", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("a", type=Path, help="the baseline checkout")
    ap.add_argument("b", type=Path, help="the checkout to compare")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--stream", action="store_true", help="streamed (SSE) answers")
    ap.add_argument("--redis", action="store_true", help="both gateways on one redis-server")
    args = ap.parse_args(argv)
    wrk = find_wrk()
    if wrk is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-tree-ab-"))
    started: list[Proc] = []
    body = request_body(args.stream)
    try:
        backends = []
        for i in range(2):
            port = free_port()
            p = Proc(
                f"backend-{i}",
                in_tree(trees["A"], "loadtest.engine.trivial", "--port", str(port),
                        "--stream-chunks", "64", "--model", "trivial"),
                f"http://127.0.0.1:{port}",
            )  # fmt: skip
            p.start(env=_tree_env(trees["A"]), log_dir=workdir)
            started.append(p)
            backends.append(p)
        for p in backends:
            wait_http(p.url + "/health", proc=p.popen)
        overrides: dict[str, object] = {
            "collector": {"scrape_interval_s": 1.0, "stale_after_s": 5.0}
        }
        if args.redis:
            redis = redis_proc(workdir)
            redis.start(log_dir=workdir)
            started.append(redis)
            overrides["store"] = {"redis_url": redis.url}
        specs = [(EngineSpec(f"b{i}"), p.url) for i, p in enumerate(backends)]
        cfg = workdir / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(specs, **overrides), sort_keys=False))
        gateways: dict[str, Proc] = {}
        for label, tree in trees.items():
            port = free_port()
            argv_ = in_tree(tree, "proxy.cli", "serve", "--config", str(cfg),
                            "--port", str(port), "--log-level", "warning")  # fmt: skip
            g = Proc(f"gateway-{label}", argv_, f"http://127.0.0.1:{port}")
            g.start(env=_tree_env(tree), log_dir=workdir)
            started.append(g)
            gateways[label] = g
        for g in gateways.values():
            wait_post_ok(g.url, proc=g)
            # Warm up: pools, caches, the first scrape.
            run_wrk(wrk, g.url + CHAT_PATH, body, args.concurrency, 2, workdir)
        rps: dict[str, list[float]] = {"A": [], "B": []}
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        for label in _rounds(args.rounds):
            g = gateways[label]
            assert g.popen is not None
            c0 = cpu_seconds([g.popen.pid])
            load = run_wrk(wrk, g.url + CHAT_PATH, body, args.concurrency, args.duration, workdir)
            c1 = cpu_seconds([g.popen.pid])
            us = (c1 - c0) * 1e6 / max(load.requests, 1)
            rps[label].append(load.rps)
            cpu[label].append(us)
            print(
                f"{label} {load.rps:8.0f} req/s {us:6.0f} us/req p50 {load.p50_ms:6.2f} ms"
                f" p99 {load.p99_ms:6.2f} ms errors {load.errors}",
                flush=True,
            )
        for label in ("A", "B"):
            print(
                f"median {label}: {statistics.median(rps[label]):.0f} req/s, "
                f"{statistics.median(cpu[label]):.0f} us/req  ({trees[label]})"
            )
        r = statistics.median(b / a for a, b in zip(rps["A"], rps["B"], strict=True))
        c = statistics.median(b / a for a, b in zip(cpu["A"], cpu["B"], strict=True))
        load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"paired B/A: req/s x{r:.3f}, CPU per request x{c:.3f} (load average {load_avg})")
    finally:
        for p in reversed(started):
            p.stop(timeout_s=5)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
