"""kvroute's ranking where a server queues what one slot holds (llama.cpp's partitioned slots).

Hand-built reports shaped as the llama.cpp adapter writes them (``counts_flights``, the slot
count as ``max_num_seqs``, ``queued_up_to_tokens`` one slot's context when partitioned) for
the benchmark's fleet: ``a`` a unified pool of 4,096 cells with 4 slots, ``b`` four
partitioned slots of 1,024, ``c`` two of 2,048.
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.routing import PolicySettings, RouteRequest, classify, make_policy

NOW = 10_000.0
S = PolicySettings(safety_margin=0.0, stale_after_s=5.0, long_threshold_tokens=1_100)
KVROUTE = make_policy("kvroute", S)


def llama(
    name: str,
    slots: int,
    slot_ctx: int,
    busy: int,
    deferred: int = 0,
    inflight: int | None = None,
    pool_free: int | None = None,
) -> NodeView:
    """A partitioned server whose report shows ``busy`` of ``slots`` taken (each held
    whole) and ``deferred`` waiting, or with ``pool_free`` a unified pool of ``slot_ctx``
    cells with that much free; the gateway holds ``inflight`` requests there (default:
    those it shows)."""
    unified = pool_free is not None
    idle = slots - busy
    room = 0 if idle == 0 or deferred else slot_ctx
    if pool_free is not None:
        room = pool_free
    report = MemoryReport(
        capacity_tokens=slot_ctx if unified else slots * slot_ctx,
        free_tokens=room if unified else idle * slot_ctx * (room > 0),
        largest_free_block_tokens=room,
        running=busy,
        waiting=deferred,
        reported_at=NOW,
        counts_flights=True,
        max_num_seqs=slots,
        queued_up_to_tokens=0 if unified else slot_ctx,
    )
    count = busy + deferred if inflight is None else inflight
    # Each flight at 200 tokens: the chats the benchmark sends most.
    overlay = Overlay(reserved_tokens=200 * count, inflight=count)
    return NodeView(name, report=report, overlay=overlay)


def rank(demand: int, *nodes: NodeView) -> list[str]:
    req = RouteRequest(demand, classify(demand, S.long_threshold_tokens))
    return KVROUTE.rank(FleetSnapshot(nodes), req, NOW)


def test_every_slot_busy_a_request_joins_a_partitioned_servers_queue_not_the_gateways() -> None:
    a = llama("a", 4, 4_096, busy=4, pool_free=0)
    b = llama("b", 4, 1_024, busy=4)
    c = llama("c", 2, 2_048, busy=2)
    # A chat: either partitioned server's queue, the fewer slot turns first (b: a quarter
    # turn of its 4 slots; c: half of its 2); never the unified pool, which has no room and
    # fails every request in flight when overfilled.
    assert rank(200, a, b, c) == ["b", "c"]
    # A document one of b's slots cannot hold: c's queue only.
    assert rank(1_500, a, b, c) == ["c"]
    # Longer than every slot: held at the gateway until the pool has room, as before.
    assert rank(2_100, a, b, c) == []


def test_an_idle_slot_now_comes_before_any_queue() -> None:
    a = llama("a", 4, 4_096, busy=1, pool_free=2_048)
    b = llama("b", 4, 1_024, busy=4, inflight=2)
    c = llama("c", 2, 2_048, busy=1)
    # a and c start it now (today's order between them: a tie, by name); b, whose report
    # shows every slot busy, after them.
    assert rank(200, b, c, a) == ["a", "c", "b"]
    assert rank(1_500, b, c, a) == ["a", "c"]


def test_an_idle_slot_counts_only_if_the_gateways_flights_leave_it_idle() -> None:
    # b's report shows an idle slot, but the gateway has sent it a fourth request since:
    # that request takes the slot. c has one idle by both counts.
    b = llama("b", 4, 1_024, busy=3, inflight=4)
    c = llama("c", 2, 2_048, busy=1)
    assert rank(200, b, c) == ["c", "b"]
    # Idle by both counts, b comes first: a chat keeps off c's slots that hold documents.
    b_free = llama("b", 4, 1_024, busy=3)
    assert rank(200, b_free, c) == ["b", "c"]
    # The same for a unified pool with room: every slot taken, it is a queue to join.
    a = llama("a", 4, 4_096, busy=3, inflight=4, pool_free=3_000)
    assert rank(200, a, c) == ["c", "a"]


def test_a_request_joins_a_servers_line_only_as_the_next_one_else_it_is_held() -> None:
    # One request already waits on b (5 in flight for 4 slots), none on c: c's line.
    b = llama("b", 4, 1_024, busy=4, inflight=5)
    c = llama("c", 2, 2_048, busy=2)
    assert rank(200, b, c) == ["c"]
    # One waits on each (c's shown deferred by its report): held at the gateway, which
    # places it on whichever server makes room first.
    c = llama("c", 2, 2_048, busy=2, deferred=1)
    assert rank(200, b, c) == []
    # A unified pool with room, its slots taken and one more sent there: the same.
    a = llama("a", 4, 4_096, busy=4, inflight=5, pool_free=3_000)
    assert rank(200, a) == []
    assert rank(200, llama("a", 4, 4_096, busy=4, pool_free=3_000)) == ["a"]
