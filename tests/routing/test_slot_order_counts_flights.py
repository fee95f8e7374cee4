"""The slot order counts the gateway's own flights, not a report a scrape old.

On a server bound by its running-request limit (``max_num_seqs``), the report that shows
every slot taken is a scrape old by the time a request ranks on it: it still counts
requests that have ended. Read as ``max(report, in flight)``, a server whose slots had just
freed ranked as full and the next requests queued on the others: the do-no-harm grid's
slots cells lost their TTFT p99 to ``power_of_two`` (docs/routing.md). A server the gateway
has nothing on is judged by its report (other clients' requests).
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.routing import PolicySettings, RouteRequest, make_policy
from proxy.routing.queueing import occupied, queue_load, slot_turns

NOW = 10_000.0
KVROUTE = make_policy("kvroute", PolicySettings(safety_margin=0.0, stale_after_s=5.0))


def vllm(name: str, running: int, waiting: int, inflight: int, max_num_seqs: int = 4) -> NodeView:
    """A paged, queueing server with four slots (unless told) and KV to spare, as its last report
    shows it (``max_num_seqs=0``: its limit not learned yet)."""
    report = MemoryReport(
        capacity_tokens=200_000,
        free_tokens=150_000,
        largest_free_block_tokens=150_000,
        allocator="paged",
        block_size=16,
        running=running,
        waiting=waiting,
        queueing=True,
        max_num_seqs=max_num_seqs,
        reported_at=NOW - 0.2,
    )
    overlay = Overlay(reserved_tokens=500 * inflight, inflight=inflight)
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


def test_a_server_the_gateway_has_nothing_on_is_judged_by_its_report() -> None:
    # "busy" was filled behind the gateway's back (4 running, 3 waiting, none of them its
    # own): its report is all the gateway knows of it, and busy ranks last.
    busy = vllm("busy", running=4, waiting=3, inflight=0)
    idle = vllm("idle", running=2, waiting=0, inflight=2)
    assert occupied(busy) == 7
    assert KVROUTE.rank(FleetSnapshot((busy, idle)), RouteRequest(300, "short"), NOW) == [
        "idle",
        "busy",
    ]


def test_a_server_whose_limit_is_not_learned_yet_does_not_look_free() -> None:
    # vLLM does not export max_num_seqs; the collector learns it per server, at different
    # times. "late" has no limit yet and 12 requests in flight; "a" and "b" have learned 4
    # and hold 5 each. Ranked on slot turns, "late" had 0 turns and took every request.
    late = vllm("late", running=4, waiting=8, inflight=12, max_num_seqs=0)
    a = vllm("a", running=4, waiting=1, inflight=5)
    b = vllm("b", running=4, waiting=1, inflight=5)
    assert slot_turns(late) == 0.0 and slot_turns(a) > 0.0
    ranked = KVROUTE.rank(FleetSnapshot((late, a, b)), RouteRequest(300, "short"), NOW)
    assert ranked == ["a", "b", "late"]
    # Once every limit is known, turns order them again: a free slot first.
    c = vllm("c", running=3, waiting=0, inflight=3, max_num_seqs=8)
    d = vllm("d", running=4, waiting=0, inflight=2, max_num_seqs=2)
    assert KVROUTE.rank(FleetSnapshot((d, c)), RouteRequest(300, "short"), NOW) == ["c", "d"]
