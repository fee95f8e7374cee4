"""The simulated engine's ``/metrics``: read from the engine at scrape time, per-app registry.

A custom collector (rather than gauges set on every allocate/free) keeps the request path
free of metric updates, and a registry per app lets several engines share one process
(the tests run many). Names are those of ``proxy.core.backend_contract``; a paged engine also
exports vLLM's names, as a real vLLM server would.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from loadtest.engine.allocators import ContiguousAllocator, PagedAllocator
from proxy.core import backend_contract as c


class _ModelName(Protocol):
    @property
    def model(self) -> str: ...


class EngineState(Protocol):
    """What the exposition reads from an engine (``loadtest.engine.server.Engine`` has it).

    A protocol rather than an import of the engine: the engine imports this module, so the
    dependency runs one way only.
    """

    @property
    def allocator(self) -> ContiguousAllocator | PagedAllocator: ...
    @property
    def config(self) -> _ModelName: ...
    @property
    def started_at(self) -> float: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def allocation_failures(self) -> int: ...
    @property
    def outcomes(self) -> Mapping[str, int]: ...


FREE_GAPS = "kvroute_engine_kv_free_gaps"
REQUESTS = "kvroute_engine_requests"  # counter, label outcome (exposed as ..._total)


def _counter_base(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


class EngineCollector(Collector):
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # names depend on the allocator; collected lazily at scrape time

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        a = e.allocator
        model = e.config.model

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge(c.CAPACITY, "KV cache capacity in tokens", a.capacity_tokens)
        yield gauge(c.FREE, "Free KV cache tokens (all gaps together)", a.free_tokens)
        yield gauge(
            c.LARGEST_FREE_BLOCK,
            "Largest request the KV cache can place now, in tokens (largest contiguous gap)",
            a.largest_free_block_tokens,
        )
        info = GaugeMetricFamily(
            c.ALLOCATOR_INFO, "KV cache allocator kind", labels=["allocator", "block_size"]
        )
        info.add_metric([a.kind, str(a.block_size)], 1)
        yield info
        yield gauge(c.START_TIME, "Unix time of the engine's last (re)start", e.started_at)
        yield gauge(c.RUNNING, "Requests holding KV cache memory", e.running)
        yield gauge(c.WAITING, "Requests accepted but not yet placed (tokenizing)", e.waiting)
        yield CounterMetricFamily(
            _counter_base(c.ALLOCATION_FAILURES),
            "Requests refused because no free block could hold them (since the last restart)",
            value=e.allocation_failures,
        )
        requests = CounterMetricFamily(
            _counter_base(REQUESTS),
            "Inference requests by outcome (since the last restart)",
            labels=["outcome"],
        )
        for outcome, n in e.outcomes.items():
            requests.add_metric([outcome], n)
        yield requests
        if isinstance(a, ContiguousAllocator):
            yield gauge(FREE_GAPS, "Number of free gaps in the KV address space", a.num_gaps)
            return
        # A paged engine: vLLM's own names too.
        usage = GaugeMetricFamily(
            c.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"]
        )
        usage.add_metric([model], a.used_tokens / a.capacity_tokens if a.capacity_tokens else 0.0)
        yield usage
        for name, doc, value in (
            (c.VLLM_RUNNING, "Number of requests in model execution batches.", e.running),
            (c.VLLM_WAITING, "Number of requests waiting to be processed.", e.waiting),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], value)
            yield g
        cfg = GaugeMetricFamily(
            c.VLLM_CACHE_CONFIG,
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
        )
        cfg.add_metric([str(a.block_size), str(a.num_blocks), "auto", "False"], 1)
        yield cfg
        yield gauge(
            c.VLLM_START_TIME,
            "Start time of the process since unix epoch in seconds.",
            e.started_at,
        )


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The Prometheus text format of ``registry`` and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
