"""Preemptions tighten a node's KV budget, quiet time gives it back (proxy.core.preemption_headroom)."""

from __future__ import annotations

from proxy.core.preemption_headroom import HeadroomSettings, PreemptionHeadroom


def test_each_report_with_new_preemptions_takes_a_step_down_to_the_floor() -> None:
    h = PreemptionHeadroom(HeadroomSettings(step=0.1, floor=0.75, relax_s=10))
    assert h.observe("n", 5, 0.0) == 1.0  # the first report is the reference, not a rise
    assert h.observe("n", 5, 1.0) == 1.0
    assert round(h.observe("n", 7, 2.0), 3) == 0.9
    assert round(h.observe("n", 9, 3.0), 3) == 0.8
    assert h.observe("n", 20, 4.0) == 0.75
    assert h.nodes["n"].rises == 3
    assert h.budget("other") == 1.0


def test_quiet_time_gives_the_budget_back_step_by_step() -> None:
    h = PreemptionHeadroom(HeadroomSettings(step=0.1, floor=0.5, relax_s=10))
    h.observe("n", 0, 0.0)
    h.observe("n", 1, 1.0)
    assert round(h.observe("n", 1, 5.0), 3) == 0.9  # too soon
    assert h.observe("n", 1, 11.0) == 1.0
    assert h.observe("n", 1, 30.0) == 1.0


def test_a_restarted_engine_counting_from_zero_is_not_a_rise() -> None:
    h = PreemptionHeadroom()
    h.observe("n", 40, 0.0)
    assert h.observe("n", 0, 1.0) == 1.0
    assert h.observe("n", 1, 2.0) < 1.0
    h.forget("n")
    assert h.budget("n") == 1.0
