"""The slot order counts the gateway's own flights once a report is out of date.

On a server bound by its running-request limit (``max_num_seqs``), the report that shows
every slot taken is a scrape old by the time a request ranks on it: it still counts
requests that have ended. Read as ``max(report, in flight)``, a server whose slots had just
freed ranked as full and the next requests queued on the others: the do-no-harm grid's
slots cells lost their TTFT p99 to ``power_of_two`` (docs/routing.md). A report that nothing
the gateway did has overtaken still counts (other clients' requests).
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.gateway.local_view import LocalReservations
from proxy.routing import PolicySettings, RouteRequest, make_policy
from proxy.routing.queueing import occupied, queue_load, slot_turns

NOW = 10_000.0
KVROUTE = make_policy("kvroute", PolicySettings(safety_margin=0.0, stale_after_s=5.0))


def vllm(name: str, running: int, waiting: int, inflight: int, moved: bool = True) -> NodeView:
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
    overlay = Overlay(reserved_tokens=500 * inflight, inflight=inflight, moved_since_report=moved)
    return NodeView(name, report=report, overlay=overlay)


def test_a_server_whose_slots_freed_since_its_report_ranks_free_at_once() -> None:
    # x's report: 4 running and 2 waiting, but 3 of those have ended (3 in flight now).
    # y: 3 running by its report, 4 in flight (one sent since).
    x = vllm("x", running=4, waiting=2, inflight=3)
    y = vllm("y", running=3, waiting=0, inflight=4)
    assert occupied(x) == 3 and slot_turns(x) == 0.0
    assert slot_turns(y) > 0.0
    assert KVROUTE.rank(FleetSnapshot((x, y)), RouteRequest(300, "short"), NOW) == ["x", "y"]


def test_requests_sent_since_the_report_count_at_once() -> None:
    # Two idle servers by their reports; the gateway just sent 2 requests to p: q first.
    p = vllm("p", running=0, waiting=0, inflight=2)
    q = vllm("q", running=0, waiting=0, inflight=0)
    assert queue_load(p) == 2.0
    assert KVROUTE.rank(FleetSnapshot((p, q)), RouteRequest(300, "short"), NOW) == ["q", "p"]


def test_a_report_nothing_has_overtaken_counts_other_clients_requests() -> None:
    # "busy" was filled behind the gateway's back (4 running, 3 waiting, none of them its
    # own); the gateway has sent nothing there since the report: busy ranks last.
    busy = vllm("busy", running=4, waiting=3, inflight=0, moved=False)
    idle = vllm("idle", running=2, waiting=0, inflight=2, moved=True)
    assert occupied(busy) == 7
    assert KVROUTE.rank(FleetSnapshot((busy, idle)), RouteRequest(300, "short"), NOW) == [
        "idle",
        "busy",
    ]


def test_the_local_view_marks_a_report_overtaken_by_a_send_or_an_end() -> None:
    clock = [NOW]
    local = LocalReservations(clock=lambda: clock[0])
    before = vllm("x", running=4, waiting=0, inflight=0, moved=False)  # taken at NOW - 0.2
    assert local.apply(FleetSnapshot((before,), taken_at=NOW)).nodes[0] == before
    local.add("x", "r1", 500)
    seen = local.apply(FleetSnapshot((before,), taken_at=NOW)).nodes[0]
    assert seen.overlay.moved_since_report and seen.overlay.inflight == 1
    # A report taken after the send is current again, until the request ends.
    clock[0] = NOW + 1.0
    newer = NodeView("x", report=MemoryReport(1, 1, 1, reported_at=NOW + 0.5))
    assert (
        not local.apply(FleetSnapshot((newer,), taken_at=NOW + 1.0))
        .nodes[0]
        .overlay.moved_since_report
    )
    local.end("x", "r1")
    assert (
        local.apply(FleetSnapshot((newer,), taken_at=NOW + 1.0)).nodes[0].overlay.moved_since_report
    )
