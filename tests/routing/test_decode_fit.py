"""The decode step of a long two-step request: best fit among the decode servers that fit."""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView
from proxy.routing.decode_fit import DecodeFitPolicy
from proxy.routing.kvroute import KvroutePolicy
from proxy.routing.policy import RouteRequest


def decode(name: str, free: int, capacity: int = 12_000) -> NodeView:
    report = MemoryReport(capacity, free, free, "paged", 16, queueing=True, reported_at=0.0)
    return NodeView(name, report=report)


FLEET = FleetSnapshot((decode("roomy", 11_000), decode("tight", 5_000), decode("full", 1_000)))


def test_a_long_request_goes_where_the_least_room_still_holds_it() -> None:
    inner = KvroutePolicy()
    policy = DecodeFitPolicy(inner)
    assert policy.checks_fit and policy.settings is inner.settings
    long_ = RouteRequest(4_000, "long")
    # The inner order spreads (the least KV in use first); what fits is the inner's say.
    assert inner.rank(FLEET, long_, 0.0) == ["roomy", "tight"]
    assert policy.rank(FLEET, long_, 0.0) == ["tight", "roomy"]
    # The roomy server stays whole for a document only it can hold.
    assert policy.rank(FLEET, RouteRequest(6_000, "long"), 0.0) == ["roomy"]


def test_short_requests_and_a_cached_prefix_keep_the_inner_order() -> None:
    policy = DecodeFitPolicy(KvroutePolicy())
    short = RouteRequest(300, "short")
    assert policy.rank(FLEET, short, 0.0) == KvroutePolicy().rank(FLEET, short, 0.0)
    cached = RouteRequest(4_000, "long", cached={"roomy": 3_000})
    assert policy.rank(FLEET, cached, 0.0) == KvroutePolicy().rank(FLEET, cached, 0.0)
    assert policy.rank(FLEET, cached, 0.0)[0] == "roomy"
