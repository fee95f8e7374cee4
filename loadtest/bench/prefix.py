"""Prefix-cache affinity end to end: the shared-document workload through the real gateway.

Four simulated vLLM engines (``--behaviour vllm``: paged, lazy, queueing, automatic prefix
cache) behind the gateway, one fresh fleet per run, the same requests (same seed, same
arrival times, streamed) for each of: round robin, kvroute without affinity
(``routing.prefix.enabled: false``), kvroute with affinity. Measured: the engines' own
prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``), the
client's time to first token (p50, p99), the engines' preemptions, failed requests. Then the
same on contiguous (fragmenting, allocate-at-admission) engines, kvroute with and without
affinity: failed requests, since there a cached prefix saves nothing in memory.

The vLLM engines prefill one prompt after another (``--serial-prefill``, one GPU's compute,
as the offline simulator models it; ``--prefill parallel``: every prompt at full speed at
once, the engine's older model, where a cache hit cannot shorten anyone else's wait). Each
row also says where the time to first token goes (``breakdown``): chats, the first question
about each document (nobody can have it cached), later ones, the engines' own TTFT, the
gateway's decision time and the router process's CPU per request. ``--repeat N`` runs the
rows N times interleaved and pools them (one busy spell of a shared machine then falls on
every row): the p99 of 240 requests is the third-slowest one.

    python -m loadtest.bench.prefix                      # both fleets, ~2.5 min on 2 cores
    python -m loadtest.bench.prefix --only vllm --repeat 2 --json out/prefix.json --plot docs/img/prefix.png
    python -m loadtest.bench.prefix --only vllm --rows "consistent,+ affinity"   # some rows

Peers, where installed: vllm-router (the Rust router; PyPI ships it as a prebuilt wheel,
``python -m venv /tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router``)
with ``--policy cache_aware`` (its default: approximate prefix tree per worker, with load
balancing thresholds) and ``--policy consistent_hash``, straight in front of the same
engines. Without it those rows are skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.overhead_load import cpu_seconds
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.local_fleet import EngineSpec, LocalFleet, Proc, free_port
from loadtest.workload import SharedDocs, Turn, conversation_messages, shared_documents


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    engines: str  # "vllm" or "contiguous"
    policy: str
    affinity: bool


RUNS = (
    Run("round robin", "vllm", "round_robin", False),
    Run("vllm-router cache_aware", "vllm", "vllm-router:cache_aware", False),
    Run("vllm-router consistent_hash", "vllm", "vllm-router:consistent_hash", False),
    Run("kvroute, no affinity", "vllm", "kvroute", False),
    Run("kvroute + affinity", "vllm", "kvroute", True),
    Run("kvroute, no affinity", "contiguous", "kvroute", False),
    Run("kvroute + affinity", "contiguous", "kvroute", True),
)


@dataclass
class Outcome:
    label: str
    engines: str
    requests: int = 0
    failed: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    doc_ttft_p50_ms: float = 0.0
    hit_rate: float = 0.0
    preemptions: int = 0
    wall_s: float = 0.0
    by_backend: dict[str, int] = field(default_factory=dict)
    # Where the time to first token goes (see ``breakdown``).
    breakdown: dict[str, float] = field(default_factory=dict)
    slowest: list[dict[str, Any]] = field(default_factory=list)
    # Each repeat's TTFT p99 (``--repeat``: the row's p99 is over all repeats' requests).
    p99_each_ms: list[float] = field(default_factory=list)
    # Raw material for pooling repeats (not written out).
    results: list[dict[str, Any]] = field(default_factory=list, repr=False)
    metrics: list[dict[str, float]] = field(default_factory=list, repr=False)


def bodies(w: SharedDocs) -> list[dict[str, Any]]:
    """Every request's chat body, built up front (the clock is for sending only)."""
    history: dict[int, list[Turn]] = {}
    out = []
    for t in w.turns:
        past = history.setdefault(t.conversation, [])
        msgs = conversation_messages(w, t, past)
        past.append(t)
        out.append(
            {
                "model": "sim-model",
                "messages": msgs,
                "max_tokens": t.output_tokens,
                "stream": True,
            }
        )
    return out


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def drive(
    gw: str | Sequence[str], w: SharedDocs, payloads: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Open loop at the workload's arrival times; each result: status, ttft, backend, kind.

    Several gateway URLs (replicas): request i goes to ``gw[i % len(gw)]`` (round robin).
    """
    urls = [gw] if isinstance(gw, str) else list(gw)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        start = time.monotonic()

        seen: set[int] = set()

        async def one(t: Turn, body: dict[str, Any], first: bool, gw: str) -> None:
            t0 = time.monotonic()
            res: dict[str, Any] = {"kind": t.kind, "status": 0, "ttft": None, "backend": ""}
            res.update(doc=t.doc, turn=t.turn, first=first, at=round(t0 - start, 3))
            try:
                async with client.stream("POST", gw + "/v1/chat/completions", json=body) as r:
                    res["status"] = r.status_code
                    res["backend"] = r.headers.get("x-kvroute-backend", "")
                    async for _ in r.aiter_bytes():
                        if res["ttft"] is None:
                            res["ttft"] = time.monotonic() - t0
            except httpx.HTTPError:
                res["status"] = -1
            results.append(res)

        tasks: list[asyncio.Task[None]] = []
        for t, body in zip(w.turns, payloads, strict=True):
            delay = start + t.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            first = t.doc is not None and t.doc not in seen
            if t.doc is not None:
                seen.add(t.doc)
            url = urls[len(tasks) % len(urls)]
            tasks.append(asyncio.create_task(one(t, body, first, url)))
        await asyncio.gather(*tasks)
    return results


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def histogram(url: str, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets (upper bound, count), all label sets summed."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
    return sorted(buckets.items())


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (coarse, but never flattering)."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    want = q * buckets[-1][1]
    return next(le for le, n in buckets if n >= want)


def breakdown(
    results: Sequence[dict[str, Any]], metrics: Sequence[dict[str, float]], gateway: str | None
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """TTFT by kind of request, the engines' own share, the gateway's decision time; the slowest.

    ``new doc``: the first question about a document in the workload (nobody can have it
    cached); ``known doc``: any later one. The engines' TTFT starts when the request reaches
    their scheduler (queueing for KV + prefill); the gateway's decision time is intake to the
    first ranking (sizing, affinity hashing, ranking).
    """
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    out: dict[str, float] = {}
    kinds = {
        "chat": ("chat", False),
        "new doc": ("document", True),
        "known doc": ("document", False),
    }
    for label, (kind, first) in kinds.items():
        v = [r["ttft"] for r in ok if r["kind"] == kind and (kind == "chat" or r["first"] == first)]
        out[f"{label} n"] = len(v)
        out[f"{label} p50 ms"] = 1000 * statistics.median(v) if v else 0.0
        out[f"{label} max ms"] = 1000 * max(v) if v else 0.0
    n = sum(m.get("vllm:time_to_first_token_seconds_count", 0.0) for m in metrics)
    total = sum(m.get("vllm:time_to_first_token_seconds_sum", 0.0) for m in metrics)
    out["engine ttft mean ms"] = 1000 * total / n if n else 0.0
    # Long prompts only: waiting at the engine before their prefill starts (placement).
    n = sum(m.get("sim:long_prefills_total", 0.0) for m in metrics)
    total = sum(m.get("sim:long_prefill_wait_seconds_total", 0.0) for m in metrics)
    out["engine long-prompt wait mean ms"] = 1000 * total / n if n else 0.0
    if gateway is not None:
        b = histogram(gateway, "kvroute_routing_decision_seconds")
        out["gateway decision p50 ms"] = 1000 * bucket_quantile(b, 0.5)
        out["gateway decision p99 ms"] = 1000 * bucket_quantile(b, 0.99)
    slow = sorted(ok, key=lambda r: -r["ttft"])[:6]
    return out, [{**r, "ttft": round(1000 * r["ttft"])} for r in slow]


def fleet_for(run: Run, capacity: int, speedup: float, serial: bool = True) -> LocalFleet:
    extra: tuple[str, ...] = ("--behaviour", "vllm") if run.engines == "vllm" else ()
    if extra and serial:
        extra += ("--serial-prefill",)
    specs = [
        EngineSpec(f"e{i}", allocator="contiguous", capacity_tokens=capacity, speedup=speedup)
        for i in range(4)
    ]
    specs = [
        EngineSpec(s.name, s.pool, s.allocator, s.capacity_tokens, s.speedup, s.block_size, extra)
        for s in specs
    ]
    overrides: dict[str, Any] = {
        "routing": {"prefix": {"enabled": run.affinity}},
        "queue": {"max_wait_s": 20.0},
        "upstream": {"total_timeout_s": 120.0},
    }
    return LocalFleet(specs, policy=run.policy, config_overrides=overrides)


def wait_reported(gw: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backends = httpx.get(gw + "/fleet", timeout=5.0).json()["backends"]
        if all(b.get("report") for b in backends):
            return
        time.sleep(0.1)
    raise RuntimeError("the engines did not report in time")


def wait_serving(url: str, proc: Proc, timeout_s: float = 60.0) -> None:
    """A router is ready when a real request gets a 200 through it."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited (log: {proc.log_path})")
        try:
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never served within {timeout_s}s")


def start_vllm_router(exe: str, policy: str, fleet: LocalFleet) -> Proc:
    port = free_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    # Its metrics listener defaults to port 29000: a second router on the box would collide.
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--log-level", "warning", "--worker-urls", *(p.url for p in fleet.engines)]
    proc = Proc("vllm-router", argv, f"http://127.0.0.1:{port}")
    proc.start(log_dir=fleet.workdir)
    wait_serving(proc.url, proc)
    return proc


def one_run(run: Run, w: SharedDocs, payloads: list[dict[str, Any]], args: Any) -> Outcome | None:
    """One fresh fleet, one router, the whole workload; None when the router is not installed."""
    capacity = args.capacity if run.engines == "vllm" else args.contiguous_capacity
    peer = run.policy.partition("vllm-router:")[2]
    exe = find_vllm_router(None) if peer else None
    if peer and exe is None:
        print(f"skipped {run.label}: vllm-router not installed (see the module docstring)")
        return None
    fleet = fleet_for(run, capacity, args.speedup, args.prefill == "serial")
    router: Proc | None = None
    try:
        fleet.start_engines()
        if exe is not None:
            router = start_vllm_router(exe, peer, fleet)
            url = router.url
        else:
            if run.engines == "vllm":
                # The backends are vLLM servers: read with the vLLM adapter.
                fleet.config_overrides["backends"] = [
                    {"name": s.name, "url": p.url, "kind": "vllm"}
                    for s, p in zip(fleet.specs, fleet.engines, strict=True)
                ]
            fleet.start_gateway(run.policy)
            url = fleet.gateway_url
            wait_reported(url)
        served_by = router if router is not None else fleet.gateway
        pid = served_by.popen.pid if served_by is not None and served_by.popen else None
        cpu0 = cpu_seconds([pid]) if pid else 0.0
        t0 = time.monotonic()
        results = asyncio.run(drive(url, w, payloads))
        wall = time.monotonic() - t0
        cpu = (cpu_seconds([pid]) - cpu0) if pid else 0.0
        metrics = [scrape(p.url) for p in fleet.engines]
        split = breakdown(results, metrics, None if exe is not None else url)
        split[0]["router cpu ms per request"] = 1000 * cpu / max(1, len(results))
    finally:
        if router is not None:
            router.stop()
        fleet.stop()
    ok = [r for r in results if r["status"] == 200]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    doc_ttfts = [r["ttft"] for r in ok if r["ttft"] is not None and r["kind"] == "document"]
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in metrics)
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in metrics)
    by_backend: dict[str, int] = {}
    for r in ok:
        by_backend[r["backend"]] = by_backend.get(r["backend"], 0) + 1
    return Outcome(
        label=run.label,
        engines=run.engines,
        requests=len(results),
        failed=len(results) - len(ok),
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else 0.0,
        ttft_p99_ms=1000 * pct(ttfts, 0.99),
        doc_ttft_p50_ms=1000 * statistics.median(doc_ttfts) if doc_ttfts else 0.0,
        hit_rate=hits / queries if queries else 0.0,
        preemptions=int(sum(m.get("vllm:num_preemptions_total", 0.0) for m in metrics)),
        wall_s=wall,
        by_backend=dict(sorted(by_backend.items())),
        breakdown=split[0],
        slowest=split[1],
        p99_each_ms=[1000 * pct(ttfts, 0.99)],
        results=results,
        metrics=metrics,
    )


def pooled(runs: Sequence[Outcome]) -> Outcome:
    """One row from repeats of it: percentiles and hit rate over all their requests."""
    if len(runs) == 1:
        return runs[0]
    results = [r for o in runs for r in o.results]
    metrics = [m for o in runs for m in o.metrics]
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttfts = [r["ttft"] for r in ok]
    docs = [r["ttft"] for r in ok if r["kind"] == "document"]
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in metrics)
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in metrics)
    split, slow = breakdown(results, metrics, None)
    for key in ("gateway decision p50 ms", "gateway decision p99 ms", "router cpu ms per request"):
        got = [o.breakdown[key] for o in runs if key in o.breakdown]
        if got:
            split[key] = statistics.median(got)
    by_backend: dict[str, int] = {}
    for o in runs:
        for k, v in o.by_backend.items():
            by_backend[k] = by_backend.get(k, 0) + v
    return Outcome(
        label=runs[0].label,
        engines=runs[0].engines,
        requests=len(results),
        failed=sum(o.failed for o in runs),
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else 0.0,
        ttft_p99_ms=1000 * pct(ttfts, 0.99),
        doc_ttft_p50_ms=1000 * statistics.median(docs) if docs else 0.0,
        hit_rate=hits / queries if queries else 0.0,
        preemptions=sum(o.preemptions for o in runs),
        wall_s=sum(o.wall_s for o in runs),
        by_backend=dict(sorted(by_backend.items())),
        breakdown=split,
        slowest=slow,
        p99_each_ms=[p for o in runs for p in o.p99_each_ms],
    )


def public(o: Outcome) -> dict[str, Any]:
    """What is printed and written: everything but the raw results."""
    out = asdict(o)
    del out["results"], out["metrics"]
    return out


def table(outcomes: Sequence[Outcome]) -> str:
    head = (
        "| engines | routing | hit rate | TTFT p50 ms | TTFT p99 ms | doc TTFT p50 ms "
        "| preemptions | failed |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {o.engines} | {o.label} | {o.hit_rate:.1%} | {o.ttft_p50_ms:.0f} | "
        f"{o.ttft_p99_ms:.0f} | {o.doc_ttft_p50_ms:.0f} | {o.preemptions} | "
        f"{o.failed}/{o.requests} |"
        for o in outcomes
    ]
    return "\n".join([head, *rows])


def plot(outcomes: Sequence[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vllm = [o for o in outcomes if o.engines == "vllm"]
    if not vllm:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=80)
    labels = [o.label.replace("vllm-router ", "vllm-router\n").replace(", ", "\n") for o in vllm]
    colours = ["#1b7837" if "affinity" in o.label and "+" in o.label else "#888888" for o in vllm]
    axes[0].bar(labels, [100 * o.hit_rate for o in vllm], color=colours)
    axes[0].set_title("prefix-cache hit rate (%)")
    x = range(len(vllm))
    axes[1].bar([i - 0.2 for i in x], [o.ttft_p50_ms for o in vllm], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [o.ttft_p99_ms for o in vllm], 0.4, label="p99")
    axes[1].set_xticks(list(x), labels)
    axes[1].set_title("time to first token (ms)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.prefix", description=__doc__)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=16.0, help="requests per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--capacity", type=int, default=200_000, help="KV tokens per vLLM engine")
    p.add_argument("--contiguous-capacity", type=int, default=100_000)
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument(
        "--prefill",
        choices=("serial", "parallel"),
        default="serial",
        help="vLLM engines: prefill one prompt after another (one GPU; default) or all at once",
    )
    p.add_argument("--only", choices=("vllm", "contiguous"), default=None)
    p.add_argument(
        "--rows", default="", help="comma-separated substrings: only the rows whose label has one"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="run every row this many times, interleaved, pooled"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    w = shared_documents(args.requests, args.rate, seed=args.seed)
    payloads = bodies(w)
    rows = [
        run
        for run in RUNS
        if (args.only is None or run.engines == args.only)
        and (not args.rows or any(k in run.label for k in args.rows.split(",")))
    ]
    # Repeats interleave the rows (ABC ABC), so that a busy spell of a shared machine
    # falls on every row rather than on one.
    got: dict[Run, list[Outcome]] = {}
    for _ in range(args.repeat):
        for run in rows:
            o = one_run(run, w, payloads, args)
            if o is None:
                continue
            print(f"{o.engines:10s} {o.label:22s} {json.dumps(public(o))}", flush=True)
            got.setdefault(run, []).append(o)
    outcomes = [pooled(v) for v in got.values()]
    print(table(outcomes))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([public(o) for o in outcomes], indent=1))
    if args.plot is not None:
        plot(outcomes, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
