"""Scaling advice: restart the fragmented node, scale up only for genuine capacity shortage."""

from __future__ import annotations

from typing import Any

from proxy.config import MaintenanceConfig
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.ops.advice import advise, effective_demand_tokens
from proxy.ops.diagnosis import Failure, Trend
from proxy.ops.maintenance import bookkeeping
from proxy.ops.node_advice import can_take_out, update_below_since

NOW = 1_000_000.0
CAP = 100_000
DAY = 86_400.0
CFG = MaintenanceConfig(
    restart_after_s=300, min_interval_per_node_s=3600, min_healthy_capacity_fraction=0.5
)


def node(
    name: str,
    free: int,
    largest: int,
    *,
    uptime: float = 5 * DAY,
    up: bool = True,
    draining: bool = False,
    reserved: int = 0,
    age: float = 0.5,
    pool: str = "general",
) -> NodeView:
    r = MemoryReport(CAP, free, largest, started_at=NOW - uptime, reported_at=NOW - age)
    return NodeView(
        name=name,
        pool=pool,
        up=up,
        report=r,
        overlay=Overlay(reserved_tokens=reserved, inflight=1 if reserved else 0, draining=draining),
    )


def fleet(*nodes: NodeView) -> FleetSnapshot:
    return FleetSnapshot(tuple(nodes), taken_at=NOW)


def frag_failure(
    demand: int = 22_000, room_on: tuple[str, ...] = ("a",), free_frac: float = 0.38
) -> Failure:
    return Failure(NOW - 10, "", "fragmentation", demand, free_frac, True, room_on)


def cap_failure(demand: int = 22_000, free_frac: float = 0.08) -> Failure:
    return Failure(NOW - 10, "", "capacity", demand, free_frac, False, ())


def run(snap: FleetSnapshot, cfg: MaintenanceConfig = CFG, **kw: Any) -> Any:
    kw.setdefault(
        "below_since", update_below_since({}, snap, NOW - 600, cfg)
    )  # below for 10 minutes
    return advise(snap, NOW, cfg, stale_after_s=5.0, **kw)


def test_the_problem_statement_example_is_a_restart_not_a_scale_up() -> None:
    # Day 5: 38% free in 1,200-token gaps; a 22,000-token document fails. Two healthy peers.
    snap = fleet(
        node("a", 38_000, 1_200),
        node("b", 60_000, 60_000, uptime=DAY),
        node("c", 55_000, 55_000, uptime=DAY),
    )
    a = run(snap, failures=[frag_failure(), frag_failure()])
    assert a.action == "restart"
    assert a.restart == ("a",)
    na = a.node("a")
    assert na is not None and na.ready and na.restart_reasons == ("fragmentation", "failures")
    assert na.level == "severe" and na.largest_contiguous_free_block_ratio == round(
        1_200 / 38_000, 4
    )
    text = " ".join(a.reasons)
    assert (
        "a (fragmentation, failures)" in text
        and "2 allocation failure(s)" in text
        and "more replicas would not be needed" in text
    )
    assert (
        a.failures["fragmentation"] == 2
        and a.failures["capacity"] == 0
        and a.failures["at_high_free_memory"] == 2
    )
    # Effective demand leaves the fragmentation failures out: only memory in use counts.
    assert a.fleet["effective_demand_tokens"] == (CAP - 38_000) + (CAP - 60_000) + (CAP - 55_000)
    assert a.to_json()["nodes"][0]["candidate"] is True


def test_genuinely_full_fleet_is_scale_up() -> None:
    snap = fleet(node("a", 8_000, 8_000), node("b", 6_000, 6_000), node("c", 9_000, 9_000))
    a = run(snap, failures=[cap_failure(), cap_failure(30_000)])
    assert a.action == "scale_up" and a.restart == ()
    assert "capacity" in a.reasons[0] and "30000" in a.reasons[0]
    assert a.fleet["effective_demand_tokens"] == 3 * CAP - 23_000 + 52_000  # in use + unmet demand
    assert a.failures["capacity"] == 2 and a.failures["max_capacity_demand_tokens"] == 30_000


def test_more_capacity_than_fragmentation_failures_wins_scale_up_and_lists_the_rest() -> None:
    snap = fleet(node("a", 38_000, 1_200), node("b", 5_000, 5_000))
    a = run(snap, failures=[cap_failure(40_000), cap_failure(40_000), frag_failure()])
    assert a.action == "scale_up" and any("restart those nodes as well" in r for r in a.reasons)
    a2 = run(snap, failures=[cap_failure(40_000), frag_failure(), frag_failure()])
    assert a2.action == "restart"


def test_fragmentation_failures_on_a_node_restarted_since_do_not_outweigh_capacity() -> None:
    full = fleet(
        node("a", 8_000, 8_000, uptime=60), node("b", 6_000, 6_000)
    )  # a restarted, then filled up
    a = run(full, failures=[frag_failure(), frag_failure(), cap_failure()])
    assert a.action == "scale_up"
    assert a.failures["fragmentation"] == 2 and a.failures["fragmentation_still_fragmented"] == 0


def test_capacity_failure_that_fits_somewhere_now_is_a_passing_peak() -> None:
    # 22k failed for lack of memory a minute ago; now node a has 38k free (in gaps).
    snap = fleet(node("a", 38_000, 1_200), node("b", 60_000, 60_000, uptime=DAY))
    a = run(snap, failures=[cap_failure(22_000)])
    assert a.action == "restart" and a.restart == ("a",)
    assert a.failures["capacity"] == 1 and a.failures["capacity_still_short"] == 0
    assert any("passing peak" in r for r in a.reasons)
    b = run(fleet(node("b", 60_000, 60_000)), failures=[cap_failure(22_000)])
    assert b.action == "none" and any("passing peak" in r for r in b.reasons)


def test_no_failures_and_no_fragmentation_is_none() -> None:
    a = run(fleet(node("a", 50_000, 50_000), node("b", 20_000, 20_000)))
    assert a.action == "none" and a.restart == () and a.watch == ()


def test_below_threshold_not_long_enough_is_watch_not_restart() -> None:
    snap = fleet(node("a", 40_000, 10_000), node("b", 40_000, 40_000))
    a = run(snap, below_since=update_below_since({}, snap, NOW - 60, CFG))  # 1 minute < 5
    assert a.action == "none" and a.watch == ("a",)
    na = a.node("a")
    assert na is not None and na.below_threshold_for_s == 60 and not na.candidate


def test_below_since_keeps_the_first_time_and_drops_recovered_nodes() -> None:
    snap = fleet(node("a", 40_000, 10_000), node("b", 40_000, 40_000), node("full", 5_000, 100))
    first = update_below_since({}, snap, 100.0, CFG)
    assert first == {"a": 100.0}  # "full" is 5% free: capacity, not fragmentation
    assert update_below_since(first, snap, 200.0, CFG) == {"a": 100.0}
    assert update_below_since(first, fleet(node("a", 40_000, 39_000)), 300.0, CFG) == {}


def test_not_ready_when_the_rest_cannot_carry_the_load() -> None:
    # Two nodes, min healthy 60%: taking either out leaves 50%.
    cfg = MaintenanceConfig(
        restart_after_s=0, min_healthy_capacity_fraction=0.6, min_interval_per_node_s=0
    )
    snap = fleet(node("a", 40_000, 2_000), node("b", 90_000, 90_000))
    a = run(snap, cfg)
    na = a.node("a")
    assert a.action == "restart" and a.restart == () and na is not None and not na.ready
    assert "below min_healthy_capacity_fraction 60%" in na.why
    # The others' free memory must hold what is in flight on it.
    snap2 = fleet(
        node("a", 40_000, 2_000, reserved=50_000),
        node("b", 30_000, 30_000),
        node("c", 15_000, 15_000),
    )
    ok, why = can_take_out(snap2, "a", NOW, CFG, 5.0)
    assert not ok and "45000 tokens free for its 50000 tokens in flight" in why
    ok, why = can_take_out(fleet(node("a", 40_000, 2_000)), "a", NOW, CFG, 5.0)
    assert not ok and "no other healthy node" in why
    # Stale, down and draining peers do not count as healthy.
    snap3 = fleet(
        node("a", 40_000, 2_000),
        node("b", 90_000, 90_000, age=60),
        node("c", 90_000, 90_000, up=False),
        node("d", 90_000, 90_000, draining=True),
    )
    assert not can_take_out(snap3, "a", NOW, CFG, 5.0)[0]


def test_only_max_concurrent_restarts_are_ready_most_fragmented_first() -> None:
    snap = fleet(
        node("a", 40_000, 15_000),
        node("b", 40_000, 2_000),
        node("c", 40_000, 8_000),
        node("d", 100_000, 100_000),
        node("e", 100_000, 100_000),
    )
    a = run(snap)
    assert a.restart == ("b",)
    nc = a.node("c")
    assert (
        nc is not None and nc.candidate and not nc.ready and "max_concurrent_restarts 1)" in nc.why
    )
    two = run(
        snap,
        MaintenanceConfig(
            restart_after_s=300, max_concurrent_restarts=2, min_healthy_capacity_fraction=0.5
        ),
    )
    assert two.restart == ("b", "c")
    # A restart under way elsewhere (busy) uses the one slot: nothing else is ready, and the
    # advice stays "restart" so autoscalers hold off.
    busy = run(
        fleet(
            node("a", 40_000, 15_000, draining=True),
            node("d", 100_000, 100_000),
            node("e", 100_000, 100_000),
        ),
        busy={"a"},
    )
    assert (
        busy.action == "restart"
        and busy.restart == ()
        and busy.reasons[0].startswith("restarting now: a")
    )


def test_min_interval_and_node_state_block_a_restart() -> None:
    snap = fleet(
        node("a", 40_000, 2_000, uptime=600),
        node("b", 40_000, 2_000, draining=True),
        node("c", 100_000, 100_000),
        node("d", 100_000, 100_000),
    )
    a = run(snap)
    na, nb = a.node("a"), a.node("b")
    assert na is not None and not na.candidate and "min_interval_per_node_s" in na.why
    assert nb is not None and not nb.candidate and nb.state == "draining"
    assert a.action == "none"


def test_a_recent_attempt_blocks_the_node_and_frees_the_slot_for_the_next() -> None:
    snap = fleet(
        node("a", 40_000, 2_000),
        node("b", 40_000, 8_000),
        node("c", 100_000, 100_000),
        node("d", 100_000, 100_000),
    )
    a = run(snap, blocked_until={"a": NOW + 50})
    na = a.node("a")
    assert na is not None and not na.candidate and "next one allowed in 50s" in na.why
    assert a.restart == ("b",)  # the most fragmented is blocked: the next one gets the slot
    assert run(snap, blocked_until={"a": NOW - 1}).restart == ("a",)


def test_scheduled_and_trend_reasons() -> None:
    snap = fleet(
        node("old", 90_000, 90_000, uptime=8 * DAY),
        node("young", 90_000, 90_000, uptime=DAY),
        node("c", 100_000, 100_000),
    )
    a = run(snap, MaintenanceConfig(scheduled_restart_uptime_s=7 * DAY))
    assert a.action == "restart" and a.restart == ("old",)
    n = a.node("old")
    assert n is not None and n.restart_reasons == ("scheduled",)

    rising = {"young": Trend(20, 0.01, 0.95, 0.35, DAY, True)}
    snap2 = fleet(node("young", 60_000, 39_000, uptime=DAY), node("c", 100_000, 100_000))
    off = run(snap2, trends=rising)
    assert off.action == "none" and off.watch == ("young",)  # restart_on_trend is off by default
    on = run(snap2, MaintenanceConfig(restart_on_trend=True), trends=rising)
    ny = on.node("young")
    assert on.restart == ("young",) and ny is not None and ny.restart_reasons == ("trend",)
    assert ny.trend_per_hour == 0.01 and ny.uptime_correlation == 0.95


def test_failures_reason_only_while_the_node_still_cannot_fit_what_failed() -> None:
    cfg = MaintenanceConfig(
        restart_after_s=10_000, min_interval_per_node_s=0
    )  # the level alone is not enough yet
    still = fleet(node("a", 30_000, 20_000), node("b", 100_000, 100_000))  # ratio 0.67: above 0.5
    a = run(still, cfg, failures=[frag_failure(22_000)])
    assert a.restart == ("a",) and a.node("a").restart_reasons == ("failures",)  # type: ignore[union-attr]
    healed = fleet(
        node("a", 30_000, 25_000), node("b", 100_000, 100_000)
    )  # a 22k block exists again
    assert run(healed, cfg, failures=[frag_failure(22_000)]).action == "none"


def test_effective_demand_counts_pending_and_unmet_only() -> None:
    r = MemoryReport(CAP, 60_000, 10_000, reported_at=NOW)
    snap = fleet(
        NodeView("a", report=r, overlay=Overlay(pending_tokens=5_000)),
        NodeView("b", up=False, report=r),
    )
    fails = [frag_failure(20_000), cap_failure(7_000)]
    assert effective_demand_tokens(snap, fails) == 40_000 + 5_000 + 7_000


def test_bookkeeping_reads_restarts_from_the_shared_event_log() -> None:
    events = [  # newest first, as the store returns them
        {"type": "restart_started", "backend": "c", "restart_id": "r4", "at": NOW - 10},
        {"type": "restart_failed", "backend": "b", "restart_id": "r3", "at": NOW - 20},
        {"type": "restart_started", "backend": "b", "restart_id": "r3", "at": NOW - 30},
        {"type": "restart_done", "backend": "a", "restart_id": "r2", "at": NOW - 40},
        {"type": "restart_started", "backend": "a", "restart_id": "r2", "at": NOW - 50},
        {
            "type": "restart_started",
            "backend": "d",
            "restart_id": "r1",
            "at": NOW - 5_000,
        },  # its gateway died
        {"type": "drain", "backend": "e", "at": NOW - 60},
        {"type": "garbage"},
    ]
    b = bookkeeping(events, NOW, max_age_s=1_000)
    assert set(b.in_progress) == {"c"}
    assert b.last_started == {"c": NOW - 10, "b": NOW - 30, "a": NOW - 50, "d": NOW - 5_000}
    assert b.last_failed == {"b": NOW - 20}


def test_one_capacity_and_one_fragmentation_failure_tie_goes_to_scale_up() -> None:
    """A tie is a capacity problem: a restart cannot make room for a demand no node has free."""
    snap = fleet(node("a", 38_000, 1_200), node("b", 5_000, 5_000))
    a = run(snap, failures=[cap_failure(40_000), frag_failure(22_000)])
    assert a.failures["capacity_still_short"] == 1
    assert a.failures["fragmentation_still_fragmented"] == 1
    assert a.action == "scale_up", a.reasons


def paged_node(name: str, free: int, largest: int, block_size: int) -> NodeView:
    r = MemoryReport(
        CAP,
        free,
        largest,
        allocator="paged",
        block_size=block_size,
        started_at=NOW - 5 * DAY,
        reported_at=NOW - 0.5,
    )
    return NodeView(name=name, pool="general", up=True, report=r)


def test_still_fragmented_counts_whole_blocks() -> None:
    """A 22,005-token request needs 1,376 blocks of 16 (22,016 tokens): a 22,010-token block
    does not hold it, so the node is still fragmented for it (as NodeView.fits decides)."""
    snap = fleet(paged_node("a", 38_000, 22_010, 16), node("b", 5_000, 5_000))
    a = run(snap, failures=[frag_failure(22_005)])
    assert a.failures["fragmentation_still_fragmented"] == 1
    # A block of whole blocks that holds it: no longer fragmented for this request.
    healed = fleet(paged_node("a", 38_000, 22_016, 16), node("b", 5_000, 5_000))
    assert (
        run(healed, failures=[frag_failure(22_005)]).failures["fragmentation_still_fragmented"] == 0
    )


def test_staleness_is_judged_against_the_newest_report_as_routing_does() -> None:
    """A gateway whose loop runs late sees every report aged together: not a fleet of stale nodes.

    All reports 8 s old (stale_after_s 5): the newest report is the reference, so every node
    is up and a fragmented one can go; a node 8 s behind the others is stale. Only when even
    the newest report is over 3x stale_after_s old does the wall clock judge again.
    """
    cfg = MaintenanceConfig(
        restart_after_s=0, min_healthy_capacity_fraction=0.3, min_interval_per_node_s=0
    )
    late = fleet(
        node("a", 40_000, 2_000, age=8),
        node("b", 90_000, 90_000, age=8),
        node("c", 90_000, 90_000, age=8.5),
    )
    a = run(late, cfg)
    assert {n.name: n.state for n in a.nodes} == {"a": "up", "b": "up", "c": "up"}
    assert a.restart == ("a",)
    assert can_take_out(late, "a", NOW, cfg, 5.0)[0]
    behind = fleet(
        node("a", 40_000, 2_000, age=0.5),
        node("b", 90_000, 90_000, age=0.5),
        node("c", 90_000, 90_000, age=8.5),
    )
    assert {n.name: n.state for n in run(behind, cfg).nodes}["c"] == "stale"
    stopped = fleet(node("a", 40_000, 2_000, age=20), node("b", 90_000, 90_000, age=20))
    assert {n.state for n in run(stopped, cfg).nodes} == {"stale"}
    assert not can_take_out(stopped, "a", NOW, cfg, 5.0)[0]


def test_a_down_nodes_last_report_is_not_fleet_memory() -> None:
    # One node up with 5,000 free; one down whose last report showed 90,000 free. A
    # 20,000-token capacity failure is capacity: the down node's memory serves nobody.
    snap = fleet(node("up", 5_000, 5_000), node("gone", 90_000, 90_000, up=False))
    a = run(snap, failures=[cap_failure(20_000)])
    assert a.action == "scale_up", a.reasons
    assert a.fleet["capacity_tokens"] == CAP and a.fleet["free_tokens"] == 5_000
    assert a.fleet["largest_node_free_tokens"] == 5_000
    assert a.failures["capacity_still_short"] == 1
