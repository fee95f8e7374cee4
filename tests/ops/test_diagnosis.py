"""Diagnosis: failure classification, the failure log, and fragmentation against uptime."""

from __future__ import annotations

import random
import statistics

import pytest

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.ops.diagnosis import (
    Failure,
    FailureLog,
    FragmentationTracker,
    TrendSettings,
    classify_failure,
    failure_from_hook,
    fit,
    level,
)

CAP = 100_000


def report(
    free: int, largest: int, *, started: float = 1_000.0, at: float = 2_000.0, cap: int = CAP
) -> MemoryReport:
    return MemoryReport(cap, free, largest, started_at=started, reported_at=at)


def node(name: str, free: int, largest: int, *, up: bool = True, pending: int = 0) -> NodeView:
    return NodeView(
        name=name, up=up, report=report(free, largest), overlay=Overlay(pending_tokens=pending)
    )


def test_classify_failure_by_total_free_memory() -> None:
    assert classify_failure(22_000, 38_000) == "fragmentation"  # the problem statement's example
    assert classify_failure(22_000, 22_000) == "fragmentation"
    assert classify_failure(22_000, 21_999) == "capacity"
    assert classify_failure(22_000, None) == "capacity"


@pytest.mark.parametrize(
    ("free", "largest", "expected"),
    [
        (40_000, 40_000, "ok"),
        (40_000, 24_000, "ok"),  # ratio 0.6: not below
        (40_000, 23_000, "high"),  # 0.575
        (40_000, 19_000, "severe"),  # 0.475
        (10_000, 1_000, "full"),  # 10% free: a capacity matter whatever the layout
        (0, 0, "full"),
    ],
)
def test_levels_follow_the_problem_statement_thresholds(
    free: int, largest: int, expected: str
) -> None:
    assert level(report(free, largest)) == expected
    assert level(None) == "unknown"


def test_failure_from_hook_asks_whether_one_node_had_the_memory() -> None:
    # The gateway calls a "nothing fits" fragmentation when the fleet's free memory adds up to
    # the demand. Spread over nodes none of which could hold it, a restart would not help.
    spread = FleetSnapshot((node("a", 15_000, 15_000), node("b", 15_000, 15_000)))
    f = failure_from_hook(spread, "", "fragmentation", 22_000, 0.15, now=10.0)
    assert f.cause == "fragmentation" and not f.fixable_by_restart and f.room_on == ()

    one_has_room = FleetSnapshot(
        (node("a", 38_000, 1_200), node("b", 15_000, 15_000), node("c", 90_000, 90_000, up=False))
    )
    f = failure_from_hook(one_has_room, "", "fragmentation", 22_000, 0.38, now=10.0)
    assert f.fixable_by_restart and f.room_on == ("a",) and f.at_high_free

    pending = FleetSnapshot(
        (node("a", 38_000, 1_200, pending=20_000),)
    )  # reservations not yet in its report
    assert not failure_from_hook(
        pending, "", "fragmentation", 22_000, 0.38, now=10.0
    ).fixable_by_restart

    at_backend = failure_from_hook(None, "a", "fragmentation", 22_000, 0.38, now=10.0)
    assert at_backend.fixable_by_restart and at_backend.room_on == ("a",)
    assert not failure_from_hook(
        one_has_room, "b", "capacity", 22_000, 0.2, now=10.0
    ).fixable_by_restart


def test_failure_log_rate_counts_only_high_free_failures_in_the_last_minute() -> None:
    log = FailureLog(keep_s=90.0)
    mk = lambda at, frac: Failure(at, "a", "fragmentation", 22_000, frac, True, ("a",))  # noqa: E731
    for at, frac in [
        (900.0, 0.38),
        (950.0, 0.38),
        (990.0, 0.30),
        (995.0, 0.25),
        (999.0, 0.10),
        (1_000.0, 0.40),
    ]:
        log.add(mk(at, frac))
    # 900 is older than 60 s; 0.25 is not "above 25%"; 0.10 is a full fleet.
    assert log.rate_at_high_free(1_000.0) == pytest.approx(3 / 60)
    assert [f.at for f in log.recent(1_000.0, 10.0)] == [990.0, 995.0, 999.0, 1_000.0]
    log.prune(1_000.0)
    assert len(log) == 5
    log.prune(2_000.0)
    assert len(log) == 0


def test_fit_matches_the_statistics_module() -> None:
    rng = random.Random(3)
    xs = [rng.uniform(0, 100) for _ in range(200)]
    ys = [0.004 * x + rng.gauss(0, 0.05) for x in xs]
    slope, r = fit(xs, ys)
    assert slope == pytest.approx(statistics.linear_regression(xs, ys).slope, rel=1e-9)
    assert r == pytest.approx(statistics.correlation(xs, ys), rel=1e-9)
    assert fit([1, 2, 3], [2, 4, 6]) == pytest.approx((2.0, 1.0))
    assert fit([1, 2, 3], [6, 4, 2]) == pytest.approx((-2.0, -1.0))
    assert fit([1, 2, 3], [0.5, 0.5, 0.5]) == (0.0, 0.0)  # constant: no correlation
    assert fit([5, 5, 5], [1, 2, 3]) == (0.0, 0.0)
    assert fit([1], [1]) == (0.0, 0.0)


SETTINGS = TrendSettings(window_s=10 * 3600, sample_interval_s=60, min_samples=5)


def feed(
    tr: FragmentationTracker, name: str, started: float, points: list[tuple[float, float]]
) -> None:
    """Reports at ``started + uptime`` with fragmentation ``frag`` (free 50k, largest = 50k x (1 - frag))."""
    for uptime, frag in points:
        tr.observe(
            name, report(50_000, round(50_000 * (1 - frag)), started=started, at=started + uptime)
        )


def test_trend_rises_with_uptime_and_resets_on_restart() -> None:
    tr = FragmentationTracker(SETTINGS)
    # 0.05 per hour, a little noise: six days would take it to 0.38+ (the problem's "day 5").
    rng = random.Random(1)
    pts = [(h * 3600.0, min(0.95, 0.05 * h + rng.uniform(-0.01, 0.01))) for h in range(0, 12)]
    feed(tr, "a", 1_000.0, pts)
    t = tr.trend("a")
    assert t is not None
    assert t.slope_per_hour == pytest.approx(0.05, abs=0.005)
    assert t.correlation > 0.99 and t.rising
    assert t.samples == 11  # hour 0 fell out of the 10 h window
    assert t.uptime_s == 11 * 3600.0

    # Same start time again: nothing new. A newer start time: a restart, the series starts over.
    assert tr.observe("a", report(50_000, 40_000, started=1_000.0, at=1_000.0 + 11 * 3600)) is None
    restart = tr.observe("a", report(100_000, 100_000, started=90_000.0, at=90_010.0))
    assert (
        restart is not None
        and restart.previous_started_at == 1_000.0
        and restart.started_at == 90_000.0
    )
    assert tr.trend("a") is None  # too few samples since the restart
    assert tr.started_at("a") == 90_000.0


def test_flat_or_falling_fragmentation_is_not_rising() -> None:
    tr = FragmentationTracker(SETTINGS)
    feed(tr, "flat", 0.0, [(h * 3600.0, 0.45) for h in range(1, 8)])
    feed(tr, "falling", 0.0, [(h * 3600.0, 0.8 - 0.05 * h) for h in range(1, 8)])
    feed(
        tr, "low", 0.0, [(h * 3600.0, 0.01 * h) for h in range(1, 8)]
    )  # rises, but stays below 0.3
    flat, falling, low = tr.trend("flat"), tr.trend("falling"), tr.trend("low")
    assert flat is not None and not flat.rising and flat.correlation == 0.0
    assert falling is not None and not falling.rising and falling.correlation < -0.99
    assert low is not None and not low.rising and low.correlation > 0.99
    assert set(tr.trends()) == {"flat", "falling", "low"}
    tr.keep_only(["flat"])
    assert tr.names() == ["flat"]


def test_samples_closer_than_the_interval_replace_the_last_one() -> None:
    tr = FragmentationTracker(TrendSettings(sample_interval_s=60, min_samples=3))
    feed(tr, "a", 1_000.0, [(0.0, 0.1), (10.0, 0.2), (20.0, 0.3), (60.0, 0.4), (130.0, 0.5)])
    t = tr.trend("a")
    assert t is not None and t.samples == 3 and t.fragmentation == 0.5
    # Out-of-order or repeated reports are ignored.
    tr.observe("a", report(50_000, 50_000, started=1_000.0, at=1_100.0))
    t2 = tr.trend("a")
    assert t2 is not None and t2.fragmentation == 0.5


def test_backends_without_start_time_are_tracked_from_the_first_report() -> None:
    tr = FragmentationTracker(TrendSettings(sample_interval_s=0, min_samples=3))
    for i, frag in enumerate([0.1, 0.2, 0.3, 0.4]):
        tr.observe(
            "v",
            MemoryReport(
                CAP,
                50_000,
                round(50_000 * (1 - frag)),
                started_at=0.0,
                reported_at=500.0 + 3600 * i,
            ),
        )
    t = tr.trend("v")
    assert (
        t is not None
        and t.uptime_s == 3 * 3600
        and t.slope_per_hour == pytest.approx(0.1, abs=1e-4)
    )
