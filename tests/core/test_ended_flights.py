"""KV of flights that ended since a node's report: taken out of that report, once."""

from __future__ import annotations

from proxy.core.ended_flights import HORIZON_S, EndedFlights


def test_only_flights_ended_after_the_report_come_off_it_and_older_ones_are_dropped() -> None:
    freed = EndedFlights()
    freed.ended("a", 10.0, 3_000)
    freed.ended("a", 12.0, 1_000)
    freed.ended("b", 12.0, 500)
    # A report read at 9 shows both of a's; one read at 11 only the second.
    assert freed.since("a", 9.0) == 4_000
    assert freed.since("a", 11.0) == 1_000
    # Reports only get newer: the first is gone for good.
    assert freed.since("a", 9.0) == 1_000
    assert freed.since("a", 12.0) == 0
    assert freed.since("b", 11.0) == 500
    assert freed.since("c", 0.0) == 0


def test_a_node_no_projection_asks_about_keeps_no_more_than_the_horizon() -> None:
    freed = EndedFlights()
    for i in range(1_000):
        freed.ended("contiguous", float(i), 100)
    # Nobody asked: only the last HORIZON_S seconds' entries are kept.
    assert freed.since("contiguous", -1.0) == 100 * (int(HORIZON_S) + 1)
