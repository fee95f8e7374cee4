"""Lazy-allocation fit accounting and queue/preemption pressure (pure logic)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.fleet import MemoryReport, NodeView, Overlay
from proxy.core.lazy import lazy_headroom, projected_headroom
from proxy.core.pressure import (
    NodePressure,
    PressureConfig,
    PressureTracker,
    next_pressure,
    trigger,
)


def lazy_report(capacity: int, used: int, **kw: object) -> MemoryReport:
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=capacity - used,
        largest_free_block_tokens=capacity - used,
        allocator="paged",
        queueing=True,
        **kw,  # type: ignore[arg-type]
    )


def test_running_requests_growth_is_not_free() -> None:
    # A (800 tokens of demand) was admitted before the report, which shows only its
    # 100-token prompt in the cache. Another 800-token request must not fit.
    report = lazy_report(1_000, used=100)
    overlay = Overlay(pending_tokens=0, reserved_tokens=800, inflight=1)
    lazy = NodeView("v", report=report, overlay=overlay)
    assert lazy.usable_block() == 200
    assert not lazy.fits(800, now=0.0)
    # The contiguous rule (what a queueing server used to get) sees 900 free and over-admits.
    contiguous = NodeView("c", report=replace(report, queueing=False), overlay=overlay)
    assert contiguous.fits(800, now=0.0)


def test_reported_usage_beyond_inflight_still_counts() -> None:
    # Finished-but-not-yet-reported work and other clients show only in `used`.
    assert lazy_headroom(lazy_report(1_000, used=700), inflight_demand=300) == 300


def test_data_parallel_headroom_assumes_the_worst_split() -> None:
    r = lazy_report(2_000, used=600, engines=2, engine_free_tokens=(400, 1_000))
    r = replace(r, largest_free_block_tokens=400)
    assert lazy_headroom(r, inflight_demand=0) == 400  # the fuller engine
    assert lazy_headroom(r, inflight_demand=900) == 100  # all 900 could be on one engine


def test_a_request_pinned_to_one_engine_needs_room_only_there() -> None:
    # Engine 0 is nearly full; the gateway pins the request to engine 1 (X-data-parallel-rank).
    r = lazy_report(2_000, used=1_000, engines=2, engine_free_tokens=(50, 950))
    r = replace(r, largest_free_block_tokens=50)
    assert lazy_headroom(r, inflight_demand=0) == 50  # unpinned: the fuller engine decides
    assert lazy_headroom(r, inflight_demand=0, engine=1) == 950
    assert lazy_headroom(r, inflight_demand=600, engine=1) == 400
    assert lazy_headroom(r, inflight_demand=0, engine=0) == 50
    assert lazy_headroom(r, inflight_demand=0, engine=5) == 50  # no such engine: unpinned
    pinned = NodeView("v", report=r, overlay=Overlay(projected_tokens=0, engine=1))
    assert pinned.fits(900, now=0.0)
    assert not NodeView("v", report=r, overlay=Overlay(projected_tokens=0)).fits(900, now=0.0)


def test_a_projected_node_needs_room_for_the_peak_not_the_whole_demand_now() -> None:
    # 600 held now, 400 free; the projection says the work there peaks at 300 besides the
    # new request's own demand (its growth comes as others end). A 650-token request fits:
    # the rule without projection asked all 650 of the 400 free now.
    r = lazy_report(1_000, used=600)
    assert lazy_headroom(r, inflight_demand=300) == 400
    assert projected_headroom(r, committed=300) == 700
    assert NodeView("v", report=r, overlay=Overlay(projected_tokens=300)).fits(650, now=0.0)
    assert not NodeView("v", report=r, overlay=Overlay(projected_tokens=400)).fits(650, now=0.0)
    # A full engine (no free block: asleep, or full) has no room whatever the projection says.
    full = replace(r, largest_free_block_tokens=0)
    assert projected_headroom(full, committed=0) == 0


def test_projected_room_on_a_data_parallel_server() -> None:
    r = lazy_report(2_000, used=1_000, engines=2, engine_free_tokens=(50, 950))
    r = replace(r, largest_free_block_tokens=50)
    # Pinned to engine 1: that engine's capacity less its projection.
    assert projected_headroom(r, committed=200, engine=1) == 800
    # The front end picks the engine: the worst split, as without projection.
    assert projected_headroom(r, committed=200) == lazy_headroom(r, 200) == 50
    assert projected_headroom(r, committed=200, engine=7) == 50


def test_sleeping_node_has_no_headroom() -> None:
    r = replace(lazy_report(1_000, used=0), largest_free_block_tokens=0, sleeping=True)
    assert lazy_headroom(r, 0) == 0


@settings(max_examples=300, deadline=None)
@given(data=st.data(), engines=st.integers(1, 3), capacity=st.integers(64, 4_096))
def test_lazy_accounting_never_over_admits(
    data: st.DataObject, engines: int, capacity: int
) -> None:
    """Whatever the arrivals, growth, completions, report staleness and engine choice, every
    engine's in-flight full demand stays within its capacity (so nothing needs preempting)."""
    demand: list[int] = []  # full demand of in-flight requests
    engine_of: list[int] = []
    allocated: list[int] = []
    report = lazy_report(
        capacity * engines, 0, engines=engines, engine_free_tokens=(capacity,) * engines
    )
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["arrive", "grow", "finish", "report"]))
        if op == "arrive":
            d = data.draw(st.integers(1, capacity))
            if d <= lazy_headroom(report, sum(demand)):
                demand.append(d)
                engine_of.append(data.draw(st.integers(0, engines - 1)))  # the server picks
                allocated.append(data.draw(st.integers(0, d)))  # prefill may have started
        elif op == "grow" and demand:
            i = data.draw(st.integers(0, len(demand) - 1))
            allocated[i] = data.draw(st.integers(allocated[i], demand[i]))
        elif op == "finish" and demand:
            i = data.draw(st.integers(0, len(demand) - 1))
            for lst in (demand, engine_of, allocated):
                lst.pop(i)
        elif op == "report":
            used = [
                sum(a for a, e in zip(allocated, engine_of, strict=True) if e == k)
                for k in range(engines)
            ]
            free = tuple(capacity - u for u in used)
            report = replace(
                report,
                free_tokens=sum(free),
                largest_free_block_tokens=min(free),
                engine_free_tokens=free,
            )
        for k in range(engines):
            on_k = sum(d for d, e in zip(demand, engine_of, strict=True) if e == k)
            assert on_k <= capacity


# --- pressure ---------------------------------------------------------------------------------


_CLOCK = iter(range(1, 10**6))


def busy(**kw: object) -> MemoryReport:
    """A fresh report each call (a later reported_at), half full."""
    base = replace(lazy_report(1_000, used=500), reported_at=float(next(_CLOCK)))
    return replace(base, **kw)  # type: ignore[arg-type]


def test_triggers() -> None:
    assert trigger(busy(), None) == ""
    assert trigger(busy(waiting=2), None) == "slots"  # half the KV free: slots ran out
    assert trigger(busy(waiting=2, free_tokens=50, largest_free_block_tokens=50), None) == "queue"
    assert trigger(busy(preemptions=4), 3) == "preemption"
    assert trigger(busy(preemptions=4), 4) == ""
    assert trigger(busy(running=8, max_num_seqs=8), None) == "slots"
    assert trigger(busy(sleeping=True), None) == "asleep"


def test_hysteresis_holds_a_full_node_for_hold_s() -> None:
    cfg = PressureConfig(hold_s=5.0)
    s = next_pressure(NodePressure(), busy(waiting=1, free_tokens=10), 100.0, cfg)
    assert s.reason == "queue"
    s = next_pressure(s, busy(), 102.0, cfg)  # one quiet report: still full
    assert s.reason == "queue"
    s = next_pressure(s, busy(), 106.0, cfg)  # quiet for 6 s >= hold_s: free again
    assert s.reason == ""


def test_tracker_sees_preemptions_rise_between_reports() -> None:
    t = PressureTracker(PressureConfig(hold_s=5.0))
    assert not t.observe("v", busy(preemptions=10), 1.0).full  # first sight: no baseline
    twelve = busy(preemptions=12)
    assert t.observe("v", twelve, 2.0).reason == "preemption"
    assert t.observe("v", twelve, 2.5).reason == "preemption"  # the same report again: no change
    assert t.reason("v", 3.0) == "preemption"
    assert t.reason("v", 8.0) == ""  # no trigger for hold_s
    assert (
        NodeView("v", report=busy(), overlay=Overlay(pressure="preemption")).fits(1, 0.0) is False
    )
