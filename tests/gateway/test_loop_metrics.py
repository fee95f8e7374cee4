"""``proxy.gateway.loop_metrics``: an unlocked child exposes what prometheus_client's own
would, for the same updates (pure logic: two registries side by side)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.gateway.loop_metrics import unlocked
from proxy.gateway.metrics import GatewayMetrics

BOUNDS = (0.001, 0.01, 0.1, 1.0, 10.0)


def pair(
    kind: type[Counter] | type[Histogram],
) -> tuple[CollectorRegistry, Counter | Histogram, CollectorRegistry, Counter | Histogram]:
    plain_reg, fast_reg = CollectorRegistry(), CollectorRegistry()
    extra = {"buckets": BOUNDS} if kind is Histogram else {}
    plain = kind("m", "doc", ["k"], registry=plain_reg, **extra)
    fast = kind("m", "doc", ["k"], registry=fast_reg, **extra)
    return plain_reg, plain, fast_reg, fast


def exposed(registry: CollectorRegistry) -> list[str]:
    """The exposition less its ``_created`` lines (the time each metric was made)."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


amounts = st.one_of(
    st.sampled_from([0.0, *BOUNDS, 10.000001, 1e9]),
    st.floats(min_value=0, max_value=100, allow_nan=False),
)


@given(st.lists(amounts, max_size=30))
def test_an_unlocked_histogram_fills_the_same_buckets(values: list[float]) -> None:
    plain_reg, plain, fast_reg, fast = pair(Histogram)
    child = unlocked(fast.labels("a"))
    plain.labels("a")
    for v in values:
        plain.labels("a").observe(v)
        child.observe(v)
    assert exposed(fast_reg) == exposed(plain_reg)


@given(st.lists(st.integers(min_value=0, max_value=5), max_size=20))
def test_an_unlocked_counter_counts_the_same(values: list[int]) -> None:
    plain_reg, plain, fast_reg, fast = pair(Counter)
    plain.labels("a").inc(3)
    fast.labels("a").inc(3)
    # Unlocked after it counted: what it held is kept.
    child = unlocked(fast.labels("a"))
    for v in values:
        plain.labels("a").inc(v)
        child.inc(v)
    assert exposed(fast_reg) == exposed(plain_reg)


def test_labels_returns_the_unlocked_child_and_the_library_checks_stay() -> None:
    _, _, fast_reg, fast = pair(Counter)
    child = unlocked(fast.labels("a"))
    # Whoever asks prometheus_client for the label set gets the same, unlocked child.
    fast.labels("a").inc()
    child.inc()
    assert fast_reg.get_sample_value("m_total", {"k": "a"}) == 2.0
    with pytest.raises(ValueError):
        child.inc(-1)


def test_a_nan_fills_no_bucket_as_with_the_library() -> None:
    plain_reg, plain, fast_reg, fast = pair(Histogram)
    plain.labels("a").observe(math.nan)
    unlocked(fast.labels("a")).observe(math.nan)
    assert [x for x in exposed(fast_reg) if "bucket" in x] == [
        x for x in exposed(plain_reg) if "bucket" in x
    ]


def test_the_gateways_request_path_metrics_are_unlocked() -> None:
    m = GatewayMetrics()
    child = m.labelled(m.requests, "short", "a", "success")
    assert m.labelled(m.requests, "short", "a", "success") is child
    child.inc()
    m.labelled(m.duration, "short").observe(0.2)
    m.decision.observe(0.003)
    get = m.registry.get_sample_value
    labels = {"class": "short", "backend": "a", "outcome": "success"}
    assert get("kvroute_requests_total", labels) == 1.0
    assert get("kvroute_request_duration_seconds_count", {"class": "short"}) == 1.0
    assert get("kvroute_routing_decision_seconds_count") == 1.0
    assert get("kvroute_routing_decision_seconds_sum") == pytest.approx(0.003)
