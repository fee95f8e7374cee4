"""Metrics of the sizing caches, read at scrape time (nothing is updated per request here).

The chunk cache is one per process (``proxy.core.chunk_count.shared_cache``), so every app
in the process reports the same numbers; with ``--workers N`` each worker has its own cache
and Prometheus sums them. Names are documented in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.core import chunked_counter, hash_memo
from proxy.gateway import sizing


class SizingCollector(Collector):
    """Chunk-cache hits, misses and size; where big requests were sized; the hash memo."""

    def collect(self) -> Iterator[Metric]:
        c = chunked_counter.shared_cache()
        yield CounterMetricFamily(
            "kvroute_sizing_chunk_cache_hits",
            "Chunks of long texts whose pieces came from the chunk cache",
            value=c.hits,
        )
        yield CounterMetricFamily(
            "kvroute_sizing_chunk_cache_misses",
            "Chunks of long texts encoded because the chunk cache did not hold them",
            value=c.misses,
        )
        hit_bytes = CounterMetricFamily(
            "kvroute_sizing_chunk_cache_bytes",
            "UTF-8 bytes of long texts sized through the chunk cache, by result",
            labels=["result"],
        )
        hit_bytes.add_metric(["hit"], c.hit_bytes)
        hit_bytes.add_metric(["miss"], c.miss_bytes)
        yield hit_bytes
        yield GaugeMetricFamily(
            "kvroute_sizing_chunk_cache_held_bytes",
            "Memory the chunk cache holds, joined tails included (bounded by sizing.chunk_cache_mb)",
            value=c.held_bytes,
        )
        yield GaugeMetricFamily(
            "kvroute_sizing_chunk_cache_entries", "Chunks the chunk cache holds", value=len(c)
        )
        yield _by_label(
            "kvroute_sizing_big_requests",
            "Requests above routing.tokenize_in_thread_chars: sized on the loop from the "
            "caches (cache), after a sizing thread encoded their new chunks (encoded), whole "
            "in a sizing thread (thread), or routed on an upper bound while counted (bound)",
            "where",
            sizing.SIZED_WHERE,
        )
        yield _by_label(
            "kvroute_prefix_hash_memo_lookups",
            "Prompts' block hashes looked up by their pieces (proxy.core.hash_memo): found "
            "whole, continued from a known prefix, or computed from nothing",
            "result",
            hash_memo.LOOKUPS,
        )


def _by_label(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter with one sample per key of ``counts`` (a process-wide dict of totals)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in counts.items():
        family.add_metric([key], n)
    return family
