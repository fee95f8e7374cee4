"""A report a scrape old still counts requests that have ended since: ranking must not.

On a server bound by its running-request limit (``max_num_seqs``), the report that shows
every slot taken is a scrape old by the time a request ranks on it; the gateway knows which
of its own requests there ended since (``LocalReservations.end``). Taken as it was, the
report ranked a server whose slots had just freed as full, and the next requests queued on
the others: the do-no-harm grid's slots cells lost their TTFT p99 to ``power_of_two``.
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.gateway.local_view import LocalReservations
from proxy.routing import PolicySettings, RouteRequest, make_policy
from proxy.routing.queueing import occupied, slot_turns

NOW = 10_000.0
KVROUTE = make_policy("kvroute", PolicySettings(safety_margin=0.0, stale_after_s=5.0))


def vllm(name: str, running: int, waiting: int, inflight: int, ended: int = 0) -> NodeView:
    """A paged, queueing server with four slots and KV to spare, as its last report shows it."""
    report = MemoryReport(
        capacity_tokens=200_000,
        free_tokens=150_000,
        largest_free_block_tokens=150_000,
        allocator="paged",
        block_size=16,
        running=running,
        waiting=waiting,
        queueing=True,
        max_num_seqs=4,
        reported_at=NOW - 0.2,
    )
    overlay = Overlay(reserved_tokens=500 * inflight, inflight=inflight, ended_since_report=ended)
    return NodeView(name, report=report, overlay=overlay)


def test_requests_that_ended_since_the_report_free_their_slots_at_once() -> None:
    # x's report: 4 running, 2 waiting; 3 of those have ended since. y: 4 running, all live.
    x = vllm("x", running=4, waiting=2, inflight=3, ended=3)
    y = vllm("y", running=4, waiting=0, inflight=4)
    assert occupied(x) == 3 and slot_turns(x) == 0.0
    assert slot_turns(y) > 0.0
    assert KVROUTE.rank(FleetSnapshot((x, y)), RouteRequest(300, "short"), NOW) == ["x", "y"]


def test_the_gateways_own_flights_still_count_when_the_report_shows_fewer() -> None:
    # Sent since the report: the report cannot show them; the in-flight count does.
    n = vllm("n", running=1, waiting=0, inflight=5, ended=2)
    assert occupied(n) == 5


def test_the_local_view_counts_ends_after_the_report_only() -> None:
    clock = [NOW]
    local = LocalReservations(clock=lambda: clock[0])
    local.add("x", "r1", 500)
    local.add("x", "r2", 500)
    local.end("x", "r1")  # at NOW, after a report of NOW - 0.2
    clock[0] = NOW + 1.0
    local.end("x", "r2")
    old = vllm("x", running=4, waiting=0, inflight=0)
    seen = local.apply(FleetSnapshot((old,), taken_at=NOW + 1.0)).nodes[0]
    assert seen.overlay.ended_since_report == 2
    # A report taken after the first end counts only the second.
    newer = NodeView("x", report=MemoryReport(1, 1, 1, reported_at=NOW + 0.5))
    assert (
        local.apply(FleetSnapshot((newer,), taken_at=NOW + 1.0)).nodes[0].overlay.ended_since_report
        == 1
    )
    assert local.ended_since("y", NOW) == 0
