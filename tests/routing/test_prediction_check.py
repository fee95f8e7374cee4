"""The model checks itself: misses turn the ranking blind, good predictions hand it back."""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.routing.decode_rate import DecodeRates
from proxy.routing.kvroute import KvroutePolicy
from proxy.routing.policy import RouteRequest
from proxy.routing.prediction_check import (
    MIN_OBSERVED,
    CheckSettings,
    PredictionCheck,
    is_miss,
)


def test_a_miss_is_off_by_the_ratio_and_the_floor_both_ways() -> None:
    s = CheckSettings(ratio=3.0, floor_s=0.5)
    assert is_miss(0.2, 2.0, s)  # a wait the model did not see
    assert is_miss(3.0, 0.3, s)  # a wait it saw where there was none
    assert not is_miss(0.01, 0.2, s)  # 20x off, but within the floor: noise
    assert not is_miss(2.0, 5.0, s)  # 2.5x: within the ratio


def test_the_ranking_falls_back_when_predictions_miss_and_returns_when_they_are_good() -> None:
    check = PredictionCheck(CheckSettings(window=20, min_samples=10))
    for _ in range(9):
        check.observe("a", 0.1, 3.0)
    assert not check.blind  # too few samples to judge
    check.observe("a", 0.1, 3.0)
    assert check.blind and check.fallbacks == 1
    # Good predictions again: blind until the misses fall to a quarter of the window.
    for i in range(14):
        check.observe("a", 1.0, 1.1)
        assert check.blind, i
    check.observe("a", 1.0, 1.1)
    assert not check.blind
    shown = check.to_json()
    assert shown["ranking"] == "model" and shown["fallbacks"] == 1
    backends = shown["backends"]
    assert isinstance(backends, dict) and backends["a"]["checked"] == 25
    assert backends["a"]["misses"] == 10


def _queueing(
    name: str, inflight: int, running: int, reserved: int = 0, role: str = "general"
) -> NodeView:
    report = MemoryReport(
        100_000, 90_000, 90_000, "paged", 16, running=running, queueing=True, reported_at=1.0
    )
    overlay = Overlay(0, reserved, inflight)
    return NodeView(name, role=role, report=report, overlay=overlay)  # type: ignore[arg-type]


def test_the_blind_ranking_is_least_outstanding_requests_then_tokens_fit_kept() -> None:
    # The model's order keeps a short request in its own pool ("a", general) while it has a
    # free slot; blind, the gateway's own outstanding counts decide: "b" has the fewest, "c"
    # ties it with more tokens.
    nodes = (
        _queueing("a", inflight=6, running=0),
        _queueing("b", inflight=2, running=9, reserved=1_000, role="long"),
        _queueing("c", inflight=2, running=9, reserved=5_000, role="long"),
    )
    snap = FleetSnapshot(nodes, taken_at=1.0)
    policy = KvroutePolicy()
    model = policy.rank(snap, RouteRequest(500, "short"), 1.0)
    blind = policy.rank(snap, RouteRequest(500, "short", blind=True), 1.0)
    assert model[0] == "a"
    assert blind == ["b", "c", "a"]
    # Fit is kept: a request no node can hold is ranked nowhere, blind or not.
    assert policy.rank(snap, RouteRequest(200_000, "long", blind=True), 1.0) == []


def test_a_hold_is_bounded_by_what_the_queue_really_cost() -> None:
    check = PredictionCheck()
    for _ in range(MIN_OBSERVED - 1):
        check.observe("a", 30.0, 0.4)
    assert check.observed_median("a") is None  # too few to bound anything
    check.observe("a", 30.0, 0.6)
    # The model predicts 30 s there; streams sent there waited 0.4-0.6 s.
    assert check.observed_median("a") == 0.4
    assert check.observed_median("b") is None


def test_the_decode_rate_is_the_median_of_recent_streams() -> None:
    rates = DecodeRates()
    rates.observe("a", 4, 1.0)  # too short to say anything
    for seconds in (1.0, 1.0, 2.0, 0.5):
        rates.observe("a", 301, seconds)
    assert rates.rate("a") is None  # four samples: not yet
    rates.observe("a", 301, 1.0)
    assert rates.rate("a") == 300.0
    rates.forget("a")
    assert rates.rate("a") is None
