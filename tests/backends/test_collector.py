"""The collector: metrics text -> MemoryReport, and real HTTP scrapes into the in-process store."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.backends.collector import LOCK_NAME, Collector
from proxy.backends.collector_metrics import CollectorMetrics
from proxy.backends.parse import ScrapeError, parse_report
from proxy.config import Config, StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state import InProcessStore, StateStore, open_store
from tests.support.busy_loop import busy_turns

NOW = 1_760_000_000.0

# --- realistic exposition texts -----------------------------------------------------------

PROCESS_AND_GC = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 21933.0
python_gc_objects_collected_total{generation="1"} 4410.0
python_gc_objects_collected_total{generation="2"} 312.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2345728e+09
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.75999e+09
"""

KVROUTE_CONTIGUOUS = """\
# HELP kvroute_engine_kv_capacity_tokens KV-cache capacity in tokens.
# TYPE kvroute_engine_kv_capacity_tokens gauge
kvroute_engine_kv_capacity_tokens 131072.0
# HELP kvroute_engine_kv_free_tokens Free KV-cache tokens (all gaps together).
# TYPE kvroute_engine_kv_free_tokens gauge
kvroute_engine_kv_free_tokens 49807.0
# HELP kvroute_engine_kv_largest_free_block_tokens Largest contiguous free block in tokens.
# TYPE kvroute_engine_kv_largest_free_block_tokens gauge
kvroute_engine_kv_largest_free_block_tokens 1200.0
# HELP kvroute_engine_allocator_info KV allocator in use.
# TYPE kvroute_engine_allocator_info gauge
kvroute_engine_allocator_info{allocator="contiguous",block_size="1"} 1.0
# HELP kvroute_engine_start_time_seconds Unix time of the last (re)start.
# TYPE kvroute_engine_start_time_seconds gauge
kvroute_engine_start_time_seconds 1.7595e+09
# HELP kvroute_engine_requests_running Requests holding KV memory.
# TYPE kvroute_engine_requests_running gauge
kvroute_engine_requests_running 37.0
# HELP kvroute_engine_requests_waiting Requests queued for KV memory.
# TYPE kvroute_engine_requests_waiting gauge
kvroute_engine_requests_waiting 2.0
# HELP kvroute_engine_allocation_failures_total Allocation failures.
# TYPE kvroute_engine_allocation_failures_total counter
kvroute_engine_allocation_failures_total 14.0
# HELP kvroute_engine_kv_free_tokens_histogram_like_decoy Not a gauge kvroute reads.
# TYPE kvroute_engine_kv_free_tokens_histogram_like_decoy gauge
kvroute_engine_kv_free_tokens_histogram_like_decoy 1.0
"""

KVROUTE_PAGED = """\
# TYPE kvroute_engine_kv_capacity_tokens gauge
kvroute_engine_kv_capacity_tokens 65536
# TYPE kvroute_engine_kv_free_tokens gauge
kvroute_engine_kv_free_tokens 32768
# TYPE kvroute_engine_kv_largest_free_block_tokens gauge
kvroute_engine_kv_largest_free_block_tokens 32768
# TYPE kvroute_engine_allocator_info gauge
kvroute_engine_allocator_info{allocator="paged",block_size="16"} 1
"""

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _histogram(name: str, labels: str) -> str:
    lines = [f"# HELP {name} Histogram.", f"# TYPE {name} histogram"]
    for le in (
        "0.001",
        "0.005",
        "0.01",
        "0.02",
        "0.04",
        "0.06",
        "0.08",
        "0.1",
        "0.25",
        "0.5",
        "1.0",
        "+Inf",
    ):
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} 17.0')
    lines.append(f"{name}_count{{{labels}}} 17.0")
    lines.append(f"{name}_sum{{{labels}}} 1.93")
    return "\n".join(lines) + "\n"


VLLM_V1_BLOCKS = 27_304
VLLM_V1 = (
    PROCESS_AND_GC
    + f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 48213.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 0.0
"""
    + _histogram("vllm:time_to_first_token_seconds", f'engine="0",model_name="{MODEL}"')
    + _histogram("vllm:e2e_request_latency_seconds", f'engine="0",model_name="{MODEL}"')
    + f"""\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="{VLLM_V1_BLOCKS}",num_gpu_blocks_override="None",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"}} 1.0
"""
)

# An older vLLM: the deprecated usage name, no engine label, two served model names.
# Usage 0.125, not 0.5: a parser that took usage for the free share must give a wrong answer.
VLLM_V0 = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="4096",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 4.0
vllm:num_requests_running{model_name="base-lora-sql"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 5.0
vllm:num_requests_waiting{model_name="base-lora-sql"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="base"} 0.125
vllm:gpu_cache_usage_perc{model_name="base-lora-sql"} 0.125
"""

# Data parallel: one series per engine; cache_config_info repeats the all-engine totals.
VLLM_DP = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 3
"""


# --- parsing ---------------------------------------------------------------------------------


def test_kvroute_contiguous_gauges() -> None:
    r = parse_report("contiguous", PROCESS_AND_GC + KVROUTE_CONTIGUOUS, NOW)
    assert r == MemoryReport(
        capacity_tokens=131_072,
        free_tokens=49_807,
        largest_free_block_tokens=1_200,
        allocator="contiguous",
        block_size=1,
        running=37,
        waiting=2,
        started_at=1.7595e9,  # the engine's own (re)start gauge, not the process start
        reported_at=NOW,
    )
    assert r.largest_block_ratio < 0.05


def test_kvroute_paged_gauges_block_size_from_labels() -> None:
    r = parse_report("paged", KVROUTE_PAGED, NOW)
    assert (r.allocator, r.block_size) == ("paged", 16)
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (
        65_536,
        32_768,
        32_768,
    )
    assert (r.running, r.waiting, r.started_at) == (0, 0, 0.0)  # optional gauges absent


def test_vllm_v1_formula_and_labels() -> None:
    r = parse_report("vllm", VLLM_V1, NOW)
    free_blocks = round((1 - 0.25) * VLLM_V1_BLOCKS)
    assert r.capacity_tokens == VLLM_V1_BLOCKS * 16
    assert r.free_tokens == free_blocks * 16 == 327_648
    assert r.largest_free_block_tokens == r.free_tokens  # paged: all free space is usable
    assert (r.allocator, r.block_size) == ("paged", 16)
    assert (r.running, r.waiting) == (3, 1)
    assert r.started_at == 1.75999e9
    assert r.reported_at == NOW


def test_vllm_deprecated_usage_name_and_summed_label_sets() -> None:
    r = parse_report("vllm", VLLM_V0, NOW)
    assert r.capacity_tokens == 4096 * 32
    assert r.free_tokens == r.largest_free_block_tokens == 3584 * 32  # 87.5% of 4096 blocks
    assert (r.running, r.waiting) == (6, 6)
    assert r.started_at == 0.0  # no process_start_time_seconds in this text


def test_vllm_data_parallel_engines() -> None:
    r = parse_report("vllm", VLLM_DP, NOW)
    # num_gpu_blocks on cache_config_info is the front end's sum over both engines,
    # repeated on each engine's series: 1000 blocks in all, 500 per engine.
    assert r.capacity_tokens == 1000 * 16
    # Usage 0.75 and 0.25 of 500 blocks each: used and free cannot be mistaken for each other.
    assert r.engine_free_tokens == (125 * 16, 375 * 16)
    assert r.free_tokens == 2_000 + 6_000
    # vLLM picks the engine by queue length: only the smallest engine's room surely fits.
    assert r.largest_free_block_tokens == 2_000
    assert (r.engines, r.running) == (2, 5)


def test_vllm_kind_prefers_kvroute_gauges_when_present() -> None:
    r = parse_report("vllm", VLLM_V1 + KVROUTE_CONTIGUOUS, NOW)
    assert r.largest_free_block_tokens == 1_200
    assert r.allocator == "contiguous"
    assert r.started_at == 1.7595e9


def test_paged_kind_falls_back_to_vllm_names() -> None:
    r = parse_report("paged", VLLM_V1, NOW)
    assert r.free_tokens == 327_648


def test_contiguous_kind_rejects_vllm_only_text() -> None:
    with pytest.raises(ScrapeError, match="kvroute_engine_kv_capacity_tokens"):
        parse_report("contiguous", VLLM_V1, NOW)


def test_capacity_override_replaces_and_clamps() -> None:
    r = parse_report("contiguous", KVROUTE_CONTIGUOUS, NOW, capacity_override=40_000)
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (
        40_000,
        40_000,
        1_200,
    )
    r = parse_report("vllm", VLLM_V1, NOW, capacity_override=100_000)
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (
        100_000,
        100_000,
        100_000,
    )
    r = parse_report("contiguous", KVROUTE_CONTIGUOUS, NOW, capacity_override=200_000)
    assert (r.capacity_tokens, r.free_tokens) == (200_000, 49_807)


def test_vllm_unknown_geometry_needs_override() -> None:
    text = VLLM_V1.replace(f'num_gpu_blocks="{VLLM_V1_BLOCKS}"', 'num_gpu_blocks="None"')
    with pytest.raises(ScrapeError, match="num_gpu_blocks"):
        parse_report("vllm", text, NOW)
    r = parse_report("vllm", text, NOW, capacity_override=80_000)
    assert (r.capacity_tokens, r.free_tokens) == (80_000, 60_000)


def test_vllm_data_parallel_override_is_shared_between_engines() -> None:
    """Data parallel without geometry: the operator's capacity is the server's, split evenly
    over its engines; a request lives on one engine that vLLM picks by queue length, not by
    free memory, so the largest block that surely fits is the smallest engine's room."""
    text = VLLM_DP.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="None"')
    r = parse_report("vllm", text, NOW, capacity_override=80_000)
    # Each engine 40,000 tokens: 25% free (usage 0.75) and 75% free (usage 0.25).
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (
        80_000,
        10_000 + 30_000,
        10_000,
    )


@pytest.mark.parametrize(
    "text",
    [
        "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>",
        '{"detail": "Not Found"}',
        "kvroute_engine_kv_capacity_tokens 131072\nkvroute_engine_kv_free_tokens lots\n",
    ],
)
def test_garbage_is_a_clear_error(text: str) -> None:
    with pytest.raises(ScrapeError, match="not valid Prometheus text"):
        parse_report("contiguous", text, NOW)


@pytest.mark.parametrize(
    ("kind", "text", "missing"),
    [
        ("contiguous", "", "kvroute_engine_kv_capacity_tokens"),
        (
            "contiguous",
            KVROUTE_CONTIGUOUS.replace("kvroute_engine_kv_largest", "x_largest"),
            "kvroute_engine_kv_largest_free_block_tokens",
        ),
        ("vllm", PROCESS_AND_GC, "vllm:kv_cache_usage_perc"),
        (
            "vllm",
            VLLM_V1.replace("vllm:cache_config_info", "vllm:other_info"),
            "vllm:cache_config_info",
        ),
    ],
)
def test_missing_metrics_are_named(kind: Any, text: str, missing: str) -> None:
    with pytest.raises(ScrapeError, match=missing):
        parse_report(kind, text, NOW)


def test_impossible_values_are_rejected() -> None:
    with pytest.raises(ScrapeError, match="not a finite"):
        parse_report("vllm", VLLM_V1.replace("} 0.25\n", "} NaN\n"), NOW)
    with pytest.raises(ScrapeError, match="fraction"):
        parse_report("vllm", VLLM_V1.replace("} 0.25\n", "} 25.0\n"), NOW)
    with pytest.raises(ScrapeError, match="negative"):
        parse_report(
            "contiguous", KVROUTE_CONTIGUOUS.replace("free_tokens 49807.0", "free_tokens -5"), NOW
        )


def test_largest_block_never_exceeds_free() -> None:
    text = KVROUTE_CONTIGUOUS.replace(
        "largest_free_block_tokens 1200.0", "largest_free_block_tokens 90000"
    )
    r = parse_report("contiguous", text, NOW)
    assert r.largest_free_block_tokens == r.free_tokens == 49_807


# --- a real metrics server on 127.0.0.1 --------------------------------------------------------


@dataclass
class MetricsServer:
    """Serves mutable /metrics bodies per path; ``/slow`` never answers in time."""

    port: int = 0
    pages: dict[str, tuple[int, str]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] = self.hits.get(path, 0) + 1
        if path == "/slow":  # never sends headers in time
            await asyncio.sleep(30)
        if path == "/drip":  # headers at once, then a line every 0.1 s for 10 s: each read is quick
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            for _ in range(100):
                await resp.write(b"# still going\n")
                await asyncio.sleep(0.1)
            await resp.write_eof()
            return resp
        status, body = self.pages.get(path, (404, "not found"))
        return web.Response(status=status, text=body, content_type="text/plain")


@pytest.fixture
async def metrics_server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", srv.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    srv.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield srv
    finally:
        await runner.cleanup()


def closed_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def make_config(backends: list[dict[str, Any]], **collector: float) -> Config:
    cc = {"scrape_interval_s": 0.05, "stale_after_s": 1.0, "timeout_s": 0.5, "report_ttl_s": 30.0}
    cc.update(collector)
    return Config.model_validate({"backends": backends, "collector": cc})


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_scrape_round_writes_reports_and_marks_failures_down(
    metrics_server: MetricsServer,
) -> None:
    metrics_server.pages = {
        "/metrics": (200, KVROUTE_CONTIGUOUS),
        "/vllm/metrics": (200, VLLM_V1),
        "/broken": (500, "Internal Server Error"),
        "/html": (200, "<html><body>login</body></html>"),
    }
    base = metrics_server.url()
    cfg = make_config(
        [
            {"name": "frag", "url": base, "kind": "contiguous"},
            {"name": "vl", "url": base, "kind": "vllm", "metrics_path": "/vllm/metrics"},
            {"name": "gone", "url": f"http://127.0.0.1:{closed_port()}", "kind": "contiguous"},
            {"name": "err", "url": base, "kind": "contiguous", "metrics_path": "/broken"},
            {"name": "junk", "url": base, "kind": "contiguous", "metrics_path": "/html"},
            {"name": "slow", "url": base, "kind": "contiguous", "metrics_path": "/slow"},
            {"name": "drip", "url": base, "kind": "contiguous", "metrics_path": "/drip"},
        ],
        # Seven scrapes share one loop: the good ones take ~10 ms, so 1.5 s is far (> 5x) from
        # failing them on a busy machine, and far (> 5x) below /slow's 30 s and /drip's 10 s.
        timeout_s=1.5,
    )
    store = InProcessStore()
    clock = Clock()
    seen: list[tuple[str, MemoryReport]] = []
    collector = Collector(cfg, store, "gw-1", clock=clock)
    collector.on_report.append(lambda name, report: seen.append((name, report)))
    try:
        outcomes = await asyncio.wait_for(collector.scrape_once(), 10)
    finally:
        await collector.stop()
    assert outcomes is not None

    states = await store.read([b.name for b in cfg.backends], NOW)
    assert states["frag"].status == "up"
    frag = states["frag"].report
    assert frag is not None and frag.largest_free_block_tokens == 1_200 and frag.reported_at == NOW
    vl = states["vl"].report
    assert states["vl"].status == "up" and vl is not None and vl.free_tokens == 327_648
    assert sorted(n for n, _ in seen) == ["frag", "vl"]

    assert states["gone"].status == "down" and "connect" in states["gone"].status_reason
    assert states["err"].status == "down" and "HTTP 500" in states["err"].status_reason
    assert (
        states["junk"].status == "down" and "not valid Prometheus" in states["junk"].status_reason
    )
    assert states["slow"].status == "down" and "timeout" in states["slow"].status_reason
    assert states["drip"].status == "down" and "body still arriving" in states["drip"].status_reason

    st = collector.status()
    assert st["rounds_total"] == 1 and st["leader"] is False  # stop() handed the lock back
    assert st["backends"]["frag"]["outcome"] == "ok" and st["backends"]["frag"]["latency_s"] > 0
    assert (
        st["backends"]["gone"]["outcome"] == "down"
        and st["backends"]["gone"]["consecutive_failures"] == 1
    )
    assert st["backends"]["frag"]["stale"] is False
    clock.t += 5
    assert collector.status()["backends"]["frag"]["stale"] is True

    # What Prometheus sees: each failure by its kind, never by its free-text reason.
    series = exported(collector)
    results = {
        dict(k)["backend"]: dict(k)["result"]
        for k, v in series["kvroute_scrapes_total"].items()
        if v == 1
    }
    assert results == {
        "frag": "ok",
        "vl": "ok",
        "gone": "connect",
        "err": "http_status",
        "junk": "bad_metrics",
        "slow": "timeout",
        "drip": "timeout",
    }
    assert len(series["kvroute_scrapes_total"]) == 7  # one result each: no zero series
    durations = {
        dict(k)["backend"]: v for k, v in series["kvroute_scrape_duration_seconds"].items()
    }
    assert durations["slow"] >= 1.5 > durations["frag"] > 0
    failing = series["kvroute_scrape_consecutive_failures"]
    assert failing[b("gone")] == 1 and failing[b("frag")] == 0
    last_ok = series["kvroute_scrape_last_success_timestamp_seconds"]
    assert last_ok[b("frag")] == NOW and last_ok[b("gone")] == 0
    assert series["kvroute_collector_leader"] == {frozenset(): 0.0}  # handed back on stop
    rounds = series["kvroute_collector_rounds_total"]
    assert rounds == {frozenset({("result", "scraped")}): 1, frozenset({("result", "skipped")}): 0}


def b(name: str) -> frozenset[tuple[str, str]]:
    return frozenset({("backend", name)})


def exported(collector: Collector) -> dict[str, dict[Any, float]]:
    """The collector's series as ``/metrics`` renders them, parsed back: name -> labels -> value."""
    registry = CollectorRegistry()
    registry.register(CollectorMetrics(collector.status))
    out: dict[str, dict[Any, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


async def test_backend_comes_back_up_and_report_follows(metrics_server: MetricsServer) -> None:
    metrics_server.pages = {"/metrics": (503, "starting")}
    cfg = make_config([{"name": "a", "url": metrics_server.url(), "kind": "paged"}])
    store = InProcessStore()
    collector = Collector(cfg, store, "gw-1")
    try:
        await collector.scrape_once()
        assert (await store.read(["a"], NOW))["a"].status == "down"
        metrics_server.pages["/metrics"] = (200, KVROUTE_PAGED)
        await collector.scrape_once()
    finally:
        await collector.stop()
    state = (await store.read(["a"], NOW))["a"]
    assert state.status == "up" and state.report is not None and state.report.block_size == 16
    b = collector.status()["backends"]["a"]
    assert (b["outcome"], b["consecutive_failures"], b["failures_total"], b["scrapes_total"]) == (
        "ok",
        0,
        1,
        2,
    )


async def test_a_busy_gateway_loop_does_not_time_its_backends_out(
    engine_factory: Callable[..., Any],
) -> None:
    # Every turn of the gateway's loop takes longer than a scrape may (0.3-0.6 s did with
    # all-new 220 KB prompts at 150 connections; here 2.5 s against 2 s, which leaves the
    # scrape thread room on a loaded machine). A scrape needs several turns: timed on this
    # loop, it ran out while the answer waited in the socket, and the backend was marked
    # down. Scraped on the collector's own thread and loop, it is up with a fresh report.
    engine = engine_factory(mode="process", name="e1")
    cfg = make_config(
        [{"name": "e1", "url": engine.url, "kind": "contiguous"}], timeout_s=2.0, fall=1
    )
    store = InProcessStore()
    collector = Collector(cfg, store, "gw-1")
    try:
        assert (await collector.scrape_once() or {})["e1"].report is not None  # idle: fine
        round_ = asyncio.ensure_future(collector.scrape_once())
        busy_turns(2.5, 5.0)
        outcomes = await asyncio.wait_for(round_, 15)
    finally:
        await collector.stop()
    assert outcomes is not None
    assert outcomes["e1"].report is not None, outcomes["e1"].reason
    assert (await store.read(["e1"], NOW))["e1"].status == "up"
    assert not [t for t in threading.enumerate() if t.name == "kvroute-scrapes-gw-1"]  # stopped


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_only_the_lock_holder_scrapes(
    metrics_server: MetricsServer, kind: str, request: pytest.FixtureRequest
) -> None:
    metrics_server.pages = {"/metrics": (200, KVROUTE_CONTIGUOUS)}
    cfg = make_config([{"name": "a", "url": metrics_server.url(), "kind": "contiguous"}])
    stores: list[StateStore]
    if kind == "redis":  # two replicas, each with its own connection to one shared Redis
        store_cfg = StoreConfig(
            redis_url=request.getfixturevalue("redis_server"),
            key_prefix=f"kvroute-{uuid.uuid4().hex[:8]}",
        )
        stores = [open_store(store_cfg), open_store(store_cfg)]
    else:
        shared = InProcessStore()
        stores = [shared, shared]
    first = Collector(cfg, stores[0], "gw-1")
    second = Collector(cfg, stores[1], "gw-2")
    second_seen: list[str] = []
    second.on_report.append(lambda name, _r: second_seen.append(name))
    try:
        assert await first.scrape_once() is not None
        hits = metrics_server.hits["/metrics"]
        assert await second.scrape_once() is None
        assert await second.scrape_once() is None
        assert metrics_server.hits["/metrics"] == hits  # the second replica left the backend alone
        assert second_seen == []
        assert second.status()["rounds_skipped_total"] == 2 and second.status()["backends"] == {}
        assert first.status()["leader"] is True
        # The scraping replica exports the per-backend series; the other says it does not scrape.
        mine, theirs = exported(first), exported(second)
        assert mine["kvroute_scrapes_total"] == {frozenset({("backend", "a"), ("result", "ok")}): 1}
        assert mine["kvroute_collector_leader"] == {frozenset(): 1.0}
        assert "kvroute_scrapes_total" not in theirs
        assert theirs["kvroute_collector_leader"] == {frozenset(): 0.0}
        assert theirs["kvroute_collector_rounds_total"][frozenset({("result", "skipped")})] == 2
        # ... and reads what the first one wrote.
        state = (await stores[1].read(["a"], NOW))["a"]
        assert (
            state.status == "up" and state.report is not None and state.report.free_tokens == 49_807
        )

        await first.stop()  # hands the lock back: the second takes over on its next round
        assert await second.scrape_once() is not None
        assert second_seen == ["a"] and second.status()["leader"] is True
        assert await stores[0].try_lock(LOCK_NAME, "gw-3", 5.0) is False
    finally:
        await first.stop()
        await second.stop()
        for st in {id(x): x for x in stores}.values():
            await st.close()


async def test_loop_runs_hooks_survives_hook_errors_and_stops(
    metrics_server: MetricsServer,
) -> None:
    metrics_server.pages = {"/metrics": (200, KVROUTE_PAGED)}
    cfg = make_config(
        [{"name": "a", "url": metrics_server.url(), "kind": "paged"}], scrape_interval_s=0.02
    )
    collector = Collector(cfg, InProcessStore(), "gw-1")
    got: list[int] = []
    enough = asyncio.Event()

    def broken(_name: str, _report: MemoryReport) -> None:
        raise RuntimeError("consumer bug")

    async def async_hook(_name: str, report: MemoryReport) -> None:
        got.append(report.free_tokens)
        if len(got) >= 3:
            enough.set()

    collector.on_report.extend([broken, async_hook])
    collector.start()
    try:
        assert collector.running
        await asyncio.wait_for(enough.wait(), 10)
    finally:
        await collector.stop()
    assert not collector.running
    assert got[:3] == [32_768] * 3
    st = collector.status()
    assert (
        st["hook_errors_total"] >= 3 and st["round_errors_total"] == 0 and st["rounds_total"] >= 3
    )


async def test_store_outage_is_counted_and_never_stops_the_loop(
    metrics_server: MetricsServer,
) -> None:
    """A Redis store that cannot be reached: every store call fails, scraping and hooks go on."""
    metrics_server.pages = {"/metrics": (200, KVROUTE_PAGED)}
    cfg = Config.model_validate(
        {
            "backends": [{"name": "a", "url": metrics_server.url(), "kind": "paged"}],
            "collector": {"scrape_interval_s": 0.02, "stale_after_s": 1.0, "timeout_s": 0.5},
            "store": {"redis_url": f"redis://127.0.0.1:{closed_port()}/0", "op_timeout_s": 0.05},
        }
    )
    store = open_store(cfg.store)
    collector = Collector(cfg, store, "gw-1")
    outage_seen = asyncio.Event()

    def hook(_name: str, _report: MemoryReport) -> None:
        # Runs after the failed put_report of the same round: the errors are already counted.
        if collector.status()["store_errors_total"] >= 4:
            outage_seen.set()

    collector.on_report.append(hook)
    collector.start()
    try:
        await asyncio.wait_for(outage_seen.wait(), 10)
        assert collector.running
    finally:
        await collector.stop()
        await store.close()
    st = collector.status()
    assert st["store_ok"] is False and st["round_errors_total"] == 0
    assert st["backends"]["a"]["outcome"] == "ok"


async def test_stop_returns_even_when_a_cancellation_is_swallowed(
    metrics_server: MetricsServer,
) -> None:
    """Libraries under the loop can lose a cancellation (a timeout racing it); stop() still ends."""
    metrics_server.pages = {"/metrics": (200, KVROUTE_PAGED)}
    cfg = make_config([{"name": "a", "url": metrics_server.url(), "kind": "paged"}])
    collector = Collector(cfg, InProcessStore(), "gw-1")
    in_hook = asyncio.Event()
    swallowed = 0

    async def stubborn(_name: str, _report: MemoryReport) -> None:
        nonlocal swallowed
        in_hook.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed += 1  # and carries on as if nothing happened

    collector.on_report.append(stubborn)
    collector.start()
    await asyncio.wait_for(in_hook.wait(), 10)
    await asyncio.wait_for(collector.stop(), 10)
    assert swallowed == 1 and not collector.running
    assert collector.status()["hook_errors_total"] == 0


async def test_reconfigure_changes_the_backends_scraped(metrics_server: MetricsServer) -> None:
    metrics_server.pages = {"/metrics": (200, KVROUTE_PAGED), "/b": (200, KVROUTE_CONTIGUOUS)}
    base = metrics_server.url()
    one = make_config([{"name": "a", "url": base, "kind": "paged"}])
    two = make_config(
        [
            {"name": "b", "url": base, "kind": "contiguous", "metrics_path": "b"},  # no slash: fine
            *({"name": f"p{i}", "url": base, "kind": "paged"} for i in range(8)),
        ]
    )
    store = InProcessStore()
    collector = Collector(one, store, "gw-1")
    try:
        assert set(await collector.scrape_once() or {}) == {"a"}
        collector.reconfigure(two)
        outcomes = await collector.scrape_once()
    finally:
        await collector.stop()
    assert outcomes is not None and all(o.ok for o in outcomes.values())
    assert set(outcomes) == {"b", *(f"p{i}" for i in range(8))}
    assert set(collector.status()["backends"]) == set(outcomes)  # "a" is gone from the status
    b = (await store.read(["b"], NOW))["b"].report
    assert b is not None and b.largest_free_block_tokens == 1_200


async def test_models_are_fetched_cached_refreshed_and_kept_on_failure(
    metrics_server: MetricsServer,
) -> None:
    models = '{"object":"list","data":[{"id":"llama-8b","object":"model","max_model_len":32768}]}'
    metrics_server.pages = {"/metrics": (200, VLLM_V1), "/v1/models": (200, models)}
    cfg = make_config(
        [
            {"name": "v", "url": metrics_server.url(), "kind": "vllm"},
            {"name": "pinned", "url": metrics_server.url(), "kind": "vllm", "models": ["a", "b"]},
        ],
        models_refresh_s=30.0,
    )
    clock = Clock()
    collector = Collector(cfg, InProcessStore(), "gw-1", clock=clock)
    try:
        await collector.scrape_once()
        info = collector.models("v")
        assert info is not None and info.ids == ("llama-8b",)
        assert info.max_model_len("llama-8b") == 32_768
        assert collector.served_models(cfg.backends[0]) == ("llama-8b",)
        assert collector.served_models(cfg.backends[1]) == ("a", "b")  # config wins
        hits = metrics_server.hits["/v1/models"]
        await collector.scrape_once()
        assert metrics_server.hits["/v1/models"] == hits  # cached within models_refresh_s
        metrics_server.pages["/v1/models"] = (500, "boom")
        clock.t += 31
        await collector.scrape_once()
        assert metrics_server.hits["/v1/models"] == hits + 2  # both backends asked again
        kept = collector.models("v")
        assert kept is not None and kept.ids == ("llama-8b",)  # a failure keeps the last list
    finally:
        await collector.stop()
