"""Disaggregated prefill/decode: kvroute vs vllm-router ``--vllm-pd-disaggregation``, or
(``--protocol sglang``) vs SGLang's own router ``--pd-disaggregation``.

Two prefill and two decode vLLM-mode engines (``kvroute engine --behaviour vllm --pd-role``:
the prefill servers hold computed blocks until a decode server pulls them, the decode servers
spend transfer time on pulled prompts, allocate lazily, queue and preempt as vLLM does).
Decode memory is the scarce resource: each decode server holds a few long requests' whole KV
(prompt + output), and the mix is the bimodal one with long outputs, sent open-loop, every
client streaming. For each router the engines start fresh and get the same request list
(same seed, same arrival times).

Routers: kvroute (decode by KV fit, prefill by expected wait, conditional disaggregation),
and vllm-router 0.1.17 in PD mode with its ``round_robin`` and ``cache_aware`` policies
(found on PATH or in /tmp/vllm-router-venv; skipped with the reason printed otherwise),
both with ``--kv-connector nixl`` against the same simulated servers. With ``--protocol
sglang`` the servers speak SGLang's protocol (``--behaviour sglang --pd-protocol sglang``:
bootstrap host, port and room sent to both servers at once) and the peer is the
``sglang-router`` package's router in PD mode with its ``round_robin`` and ``cache_aware``
policies (skipped with the reason printed where it is not installed).

Engine models (``--engine-model``): ``default`` is the engine above with the engines' rates
given to kvroute and kvroute's levers set for this fleet. ``classic`` and ``v1`` are the
do-no-harm grid's two models (``do_no_harm_cells.model_extra_flags``: an independent
vLLM-like engine, and vLLM v1's scheduler), each playing its prefill or decode role; with
either, kvroute runs as a user first deploys it: each backend's name, URL, kind and role,
nothing tuned (no rates, no levers; ``--set`` and ``--min-uncached`` still apply).

Reported per router: failed requests, preemptions on the decode servers (their own count,
from ``/admin/state``: ``vllm:num_preemptions_total`` in vLLM mode), time to first token
p50/p99 (all, and long requests), and decode KV use (sampled from the decode servers every
0.25 s): the mean of each and how far apart they are (percentage points), plus what the
prefill servers still hold at the end (blocks, or SGLang's open rooms).

    python -m loadtest.bench.pd --quick --json out/pd.json --plot docs/img/pd.png
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.bench.do_no_harm_cells import MODELS, model_extra_flags
from loadtest.bench.engine_fleet import (
    DECODE_TOKENS_PER_S,
    MODEL,
    engine_flags,
    start_gateway,
    start_sglang_router,
    start_vllm_engine,
    start_vllm_router,
)
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.bench.pd_report import breakdown, breakdown_table, plot, ratios, table
from loadtest.bench.queueing import Sample, drive
from loadtest.children import stop_processes
from loadtest.engine.behaviours.eos import marker
from loadtest.local_fleet import free_port
from loadtest.workload import Request, bimodal, chat_overhead_tokens, make_prompt

ROUTERS = ("kvroute", "vllm-router:round_robin", "vllm-router:cache_aware")
SGLANG_ROUTERS = ("kvroute", "sglang-router:round_robin", "sglang-router:cache_aware")
ENGINE_MODELS = ("default", *MODELS)
PREFILL = ("p0", "p1")
DECODE = ("d0", "d1")


@dataclass
class Outcome:
    router: str
    samples: list[Sample] = field(default_factory=list)
    decode_preemptions: int = 0
    # Per decode server: KV used fraction, one sample per tick.
    usage: dict[str, list[float]] = field(default_factory=dict)
    held_at_end: int = 0

    def ttft(self, q: float, kind: str | None = None) -> float | None:
        xs = sorted(
            s.ttft_s
            for s in self.samples
            if s.ttft_s is not None and (kind is None or s.kind == kind)
        )
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    def goodput(self) -> float:
        """Output tokens of the requests that succeeded, per second from the first arrival to
        the last token of any request."""
        ok = [s for s in self.samples if s.status == 200 and s.ttft_s is not None]
        end = max((s.sent_s + (s.total_s or 0.0) for s in self.samples), default=0.0)
        return sum(s.tokens for s in ok) / end if end > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        means = {n: sum(u) / len(u) if u else 0.0 for n, u in self.usage.items()}
        return {
            "router": self.router,
            "requests": len(self.samples),
            "failed": sum(1 for s in self.samples if s.status != 200 or s.ttft_s is None),
            "decode_preemptions": self.decode_preemptions,
            "ttft_p50": self.ttft(0.5),
            "ttft_p99": self.ttft(0.99),
            "long_ttft_p99": self.ttft(0.99, "long"),
            # What TTFT does not show: a preempted request stalls mid-stream, then recomputes.
            "max_gap_p99": pct([s.max_gap_s for s in self.samples if s.ttft_s is not None], 0.99),
            "latency_p99": pct([s.total_s for s in self.samples if s.total_s is not None], 0.99),
            "goodput_tokens_per_s": self.goodput(),
            "decode_kv_mean": means,
            "decode_kv_gap_pp": 100 * (max(means.values()) - min(means.values())) if means else 0.0,
            "prefill_held_at_end": self.held_at_end,
            "slowest": breakdown(self.samples),
            "worst": [
                {"ttft": s.ttft_s, "kind": s.kind, "sent": s.sent_s, "timing": s.timing}
                for s in sorted(self.samples, key=lambda s: -(s.ttft_s or 0.0))[:5]
            ],
        }


def pct(xs: list[float], q: float) -> float | None:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def start_engine(
    name: str, role: str, args: argparse.Namespace
) -> tuple[subprocess.Popen[str], str]:
    capacity = args.decode_capacity if role == "decode" else args.prefill_capacity
    flags = engine_flags(
        capacity,
        args.prefill,
        args.speedup,
        args.max_num_seqs,
        "--pd-role",
        role,
        *engine_model_flags(args.engine_model),
    )
    if args.protocol == "sglang":
        flags += ["--pd-protocol", "sglang"]
        if role == "prefill":
            flags += ["--disaggregation-bootstrap-port", "0"]  # a free port, in /admin/state
    return start_vllm_engine(name, flags, behaviour=args.protocol)


def engine_model_flags(engine_model: str) -> list[str]:
    """What makes every engine (prefill and decode alike) one of ``ENGINE_MODELS``."""
    return ["--serial-prefill"] if engine_model == "default" else model_extra_flags(engine_model)


def bootstrap_port(url: str) -> int:
    """An SGLang-mode prefill server's bootstrap port, from its own state."""
    return int(httpx.get(url + "/admin/state", timeout=5).json()["bootstrap_port"])


def gateway_config(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """kvroute's config: tuned for this fleet with the default engine model, else untuned."""
    backends = [backend(name, urls[name], args) for name in (*PREFILL, *DECODE)]
    if args.protocol == "sglang":
        for b in backends:
            if b["role"] == "prefill":
                b["bootstrap_port"] = bootstrap_port(b["url"])
    cfg: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": free_port()}}
    cfg["backends"] = backends
    if args.engine_model == "default":
        cfg |= tuned_sections(args)
    elif args.protocol == "sglang":
        # The protocol, not a lever: without it kvroute speaks vLLM's (NIXL) to the servers.
        cfg["disaggregation"] = {"protocol": "sglang"}
    elif args.min_uncached is not None:
        cfg["disaggregation"] = {"min_uncached_prompt_tokens": args.min_uncached}
    return with_overrides(cfg, args.set)


def backend(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One backend: name, URL, kind and role; the engines' rates with the default model only."""
    out: dict[str, Any] = {
        "name": name,
        "url": url,
        "kind": args.protocol,
        "role": "prefill" if name in PREFILL else "decode",
    }
    if args.engine_model == "default":
        out["prefill_tokens_per_s"] = args.prefill * args.speedup
        out["decode_tokens_per_s"] = DECODE_TOKENS_PER_S * args.speedup
    return out


def tuned_sections(args: argparse.Namespace) -> dict[str, Any]:
    """kvroute's levers as the default engine model's runs set them."""
    min_uncached = 512 if args.min_uncached is None else args.min_uncached
    disaggregation: dict[str, Any] = {"min_uncached_prompt_tokens": min_uncached}
    if args.protocol == "sglang":
        # No conditional disaggregation under SGLang's protocol (docs/disaggregation.md).
        disaggregation = {"protocol": "sglang"}
    return {
        "routing": {"policy": "kvroute", "long_threshold_tokens": args.long_min // 2},
        "collector": {"scrape_interval_s": 0.25, "stale_after_s": 5.0},
        "health": {"active": {"enabled": False}},
        "queue": {"max_wait_s": 30.0},
        "disaggregation": disaggregation,
    }


def with_overrides(cfg: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``cfg`` with each ``a.b.c=value`` set (the value read as YAML)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return cfg


def sglang_pd_workers(urls: dict[str, str]) -> list[str]:
    """SGLang's router in PD mode: each prefill server with its bootstrap port."""
    flags = ["--pd-disaggregation"]
    for name in PREFILL:
        flags += ["--prefill", urls[name], str(bootstrap_port(urls[name]))]
    for name in DECODE:
        flags += ["--decode", urls[name]]
    return flags


def preemptions(urls: dict[str, str]) -> int:
    """Preemptions on these servers, from their own state (both dialects keep the count)."""
    return sum(
        e["preemptions"]
        for url in urls.values()
        for e in httpx.get(url + "/admin/state", timeout=5).json()["engines"]
    )


def held(url: str, protocol: str) -> int:
    """What a prefill server still holds for a decode: blocks (NIXL) or open rooms (SGLang)."""
    st = httpx.get(url + "/admin/state", timeout=5).json()
    return int(st["bootstrap_rooms"] if protocol == "sglang" else st["kv_holds"])


def pd_workers(urls: dict[str, str]) -> list[str]:
    """vllm-router's PD mode (NIXL) over the prefill and decode servers.

    Its queue and timeout defaults (100 queued, 60 s) would fail requests a saturated fleet
    can still serve.
    """
    flags = ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for name in PREFILL:
        flags += ["--prefill", urls[name]]
    for name in DECODE:
        flags += ["--decode", urls[name]]
    return [*flags, "--queue-size", "10000", "--request-timeout-secs", "600"]


class UsageSampler:
    """Each decode server's used KV fraction, every ``tick_s``, from its own state."""

    def __init__(self, urls: dict[str, str], tick_s: float = 0.25) -> None:
        self.urls = urls
        self.tick_s = tick_s
        self.usage: dict[str, list[float]] = {n: [] for n in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> UsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(self.tick_s):
                for name, url in self.urls.items():
                    try:
                        engines = client.get(url + "/admin/state").json()["engines"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        continue
                    used = sum(e["used_tokens"] for e in engines)
                    self.usage[name].append(used / sum(e["capacity_tokens"] for e in engines))


def bodies(requests: list[Request], args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """With ``--ask``: each class asks for more output than it writes, as real clients do."""
    if args.ask is None:
        return None
    rng = random.Random(args.seed)
    overhead = chat_overhead_tokens()
    asks = {"short": args.ask[0], "long": args.ask[1]}
    out = []
    for r in requests:
        text = make_prompt(max(1, r.prompt_tokens - overhead - 4), rng) + marker(r.output_tokens)
        out.append(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max(asks[r.kind], r.output_tokens),
                "stream": True,
            }
        )
    return out


def run_router(router: str, requests: list[Request], args: argparse.Namespace) -> Outcome:
    procs: list[subprocess.Popen[str]] = []
    try:
        urls: dict[str, str] = {}
        for name in (*PREFILL, *DECODE):
            proc, urls[name] = start_engine(name, "prefill" if name in PREFILL else "decode", args)
            procs.append(proc)
        with tempfile.TemporaryDirectory() as tmp:
            peer = router.partition("vllm-router:")[2]
            sglang_peer = router.partition("sglang-router:")[2]
            if peer:
                gw, gw_url = start_vllm_router(
                    args.vllm_router_exe, peer, pd_workers(urls), Path(tmp)
                )
            elif sglang_peer:
                gw, gw_url = start_sglang_router(sglang_peer, sglang_pd_workers(urls), Path(tmp))
            else:
                gw, gw_url = start_gateway(gateway_config(urls, args), Path(tmp))
            procs.append(gw)
            decode_urls = {n: urls[n] for n in DECODE}
            with UsageSampler(decode_urls) as sampler:
                samples = asyncio.run(drive(gw_url, requests, args.seed, bodies(requests, args)))
            out = Outcome(router, samples, usage=sampler.usage)
            out.decode_preemptions = preemptions(decode_urls)
            out.held_at_end = sum(held(urls[n], args.protocol) for n in PREFILL)
        return out
    finally:
        stop_processes(procs)


def workload_requests(args: argparse.Namespace) -> list[Request]:
    """The request list of a run: the bimodal mix with long outputs (the same for each router)."""
    return bimodal(
        args.rate,
        duration_s=args.duration,
        seed=args.seed,
        short=(20, 400),
        long=(args.long_min, args.long_max),
        short_output=(64, 256),
        long_output=(512, 1_500),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.pd", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a short run (shared machines)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--decode-capacity", type=int, default=16_000, help="KV tokens per decode server"
    )
    p.add_argument(
        "--prefill-capacity", type=int, default=64_000, help="KV tokens per prefill server"
    )
    p.add_argument("--prefill", type=float, default=4_000.0, help="prefill tokens/s per engine")
    p.add_argument("--speedup", type=float, default=4.0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--long-min", type=int, default=2_000, help="long prompts: min tokens")
    p.add_argument("--long-max", type=int, default=4_000, help="long prompts: max tokens")
    p.add_argument(
        "--min-uncached",
        type=int,
        default=None,
        help="kvroute: conditional threshold (default: 512 with --engine-model default, "
        "kvroute's own default otherwise)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kvroute config override, dotted key and YAML value (a lever to measure), e.g. "
        "memory_pressure.max_overtakes=0; repeatable",
    )
    p.add_argument("--runs", type=int, default=1, help="repetitions (same requests, fresh engines)")
    p.add_argument(
        "--ask",
        type=int,
        nargs=2,
        default=None,
        metavar=("SHORT", "LONG"),
        help="max_tokens chats and documents ask for; the model stops at its own length "
        "([eos:N]). Default: each asks exactly what it writes",
    )
    p.add_argument(
        "--protocol",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the servers' PD protocol: vllm (NIXL, two steps) or sglang (bootstrap rooms)",
    )
    p.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="default",
        help="every engine's model: default (this benchmark's engine, kvroute tuned for it), "
        "or the do-no-harm grid's classic or v1 (vLLM v1's scheduler), kvroute untuned",
    )
    p.add_argument(
        "--routers",
        default=None,
        help="comma-separated (default: kvroute and the protocol's peer, two policies each)",
    )
    p.add_argument("--vllm-router", default=None, help="path of vllm-router (default: PATH, venv)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_model == "v1" and args.protocol == "sglang":
        parser.error("--engine-model v1 is vLLM's scheduler: it needs --protocol vllm")
    if args.quick:
        args.duration = min(args.duration, 20.0)
    default = SGLANG_ROUTERS if args.protocol == "sglang" else ROUTERS
    routers = (args.routers or ",".join(default)).split(",")
    if not importlib.util.find_spec("sglang_router") and any(
        r.startswith("sglang-router:") for r in routers
    ):
        print("sglang-router skipped: not installed (pip install sglang-router)", flush=True)
        routers = [r for r in routers if not r.startswith("sglang-router:")]
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    if args.vllm_router_exe is None and any(r.startswith("vllm-router:") for r in routers):
        print("vllm-router skipped: not installed (PATH or /tmp/vllm-router-venv)", flush=True)
        routers = [r for r in routers if not r.startswith("vllm-router:")]
    requests = workload_requests(args)
    rows: list[dict[str, Any]] = []
    for run in range(1, args.runs + 1):
        for router in routers:
            try:
                res = run_router(router, requests, args).summary()
            except RuntimeError as exc:
                if router == "kvroute":
                    raise
                print(f"| {run} | {router} | skipped: {exc} |", flush=True)
                continue
            res["run"] = run
            res["engine_model"] = args.engine_model
            rows.append(res)
            print(table([res]).splitlines()[-1], flush=True)
    print(table(rows))
    print(breakdown_table(rows))
    print(ratios(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
