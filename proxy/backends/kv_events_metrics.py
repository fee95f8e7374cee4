"""Prometheus view of the KV-event feeds, computed at scrape time (nothing per event).

Names are documented in docs/observability.md; events per second is
``rate(kvroute_kv_events_total[1m])``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.backends.kv_events import KvEventFeeds

_LABELS = ["backend", "rank"]


class KvEventsCollector(Collector):
    """Counters and gauges of every backend's feeds, one series per data-parallel rank."""

    def __init__(self, feeds: KvEventFeeds) -> None:
        self._feeds = feeds

    def collect(self) -> Iterator[Metric]:
        now = self._feeds.clock()
        counters, replays, orphans, blocks, age, live = _families()
        seen: set[str] = set()
        for backend, rank, feed in self._feeds.feeds():
            lv = [backend, str(rank)]
            st = feed.stats
            for key, fam in counters.items():
                fam.add_metric(lv, float(getattr(st, key)))
            replays.add_metric([*lv, "covered"], float(st.replays_ok))
            replays.add_metric([*lv, "short"], float(st.replays_short))
            orphans.add_metric(lv, float(feed.index.orphans))
            blocks.add_metric(lv, float(feed.index.blocks()))
            age.add_metric(lv, now - st.last_message_at if st.last_message_at else -1.0)
            if backend not in seen:
                seen.add(backend)
                on_events = self._feeds.source(backend, now) == "events"
                live.add_metric([backend], 1.0 if on_events else 0.0)
        yield from counters.values()
        yield from (replays, orphans, blocks, age, live)


def _families() -> tuple[
    dict[str, CounterMetricFamily],
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
]:
    """Fresh families for one scrape: counters keyed by their ``FeedStats`` field."""
    counters = {
        "events": CounterMetricFamily(
            "kvroute_kv_events", "KV-cache events applied to the exact index", labels=_LABELS
        ),
        "batches": CounterMetricFamily(
            "kvroute_kv_event_batches", "Event batches applied", labels=_LABELS
        ),
        "malformed": CounterMetricFamily(
            "kvroute_kv_event_malformed",
            "Messages or events that were not vLLM's encoding, skipped",
            labels=_LABELS,
        ),
        "gaps": CounterMetricFamily(
            "kvroute_kv_event_gaps", "Sequence gaps seen on the stream", labels=_LABELS
        ),
        "restarts": CounterMetricFamily(
            "kvroute_kv_event_restarts",
            "Publisher restarts seen (the sequence started again)",
            labels=_LABELS,
        ),
    }
    replays = CounterMetricFamily(
        "kvroute_kv_event_replays",
        "Replay requests: covered the gap, or short (index dropped and rebuilt)",
        labels=[*_LABELS, "result"],
    )
    orphans = CounterMetricFamily(
        "kvroute_kv_event_orphan_blocks",
        "Stored blocks skipped because their parent was unknown",
        labels=_LABELS,
    )
    blocks = GaugeMetricFamily(
        "kvroute_kv_event_index_blocks", "Engine blocks in the exact index", labels=_LABELS
    )
    age = GaugeMetricFamily(
        "kvroute_kv_event_age_seconds",
        "Seconds since the last message (-1: none yet)",
        labels=_LABELS,
    )
    live = GaugeMetricFamily(
        "kvroute_kv_event_live",
        "1 while routing uses the backend's events, 0 on the approximate index",
        labels=["backend"],
    )
    return counters, replays, orphans, blocks, age, live
