"""The per-node test of why nothing fits (proxy/routing/nothing_fits.py), and the two small
pieces of gateway bookkeeping it works with: this replica's reservation overlay and the
client's retry-key list. Pure logic on hand-built snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.gateway import retry_memory
from proxy.gateway.local_view import LocalReservations
from proxy.routing.nothing_fits import judge, nothing_fits_reason

NOW = 10_000.0
CAP = 100_000


def node(
    name: str,
    free: int = CAP,
    largest: int | None = None,
    up: bool = True,
    age: float = 0.0,
    **ov: Any,
) -> NodeView:
    report = MemoryReport(CAP, free, free if largest is None else largest, reported_at=NOW - age)
    return NodeView(name=name, up=up, report=report, overlay=Overlay(**ov))


def fleet(*nodes: NodeView) -> FleetSnapshot:
    return FleetSnapshot(tuple(nodes), taken_at=NOW)


@pytest.mark.parametrize(
    ("other", "exclude"),
    [
        (node("x", up=False), ()),
        (node("x", draining=True), ()),
        (node("x", cooldown_until=NOW + 5), ()),
        (node("x", age=60.0), ()),
        (node("x"), ("x",)),
    ],
    ids=["down", "draining", "cooling down", "stale", "excluded"],
)
def test_a_node_that_could_not_take_the_request_is_not_blamed_on_memory(
    other: NodeView, exclude: tuple[str, ...]
) -> None:
    # The other node is all free; the only usable one is full: capacity, not fragmentation.
    full = node("full", free=5_000)
    v = judge(fleet(full, other), 22_000, NOW, stale_after_s=5.0, exclude=exclude)
    assert v.cause == "capacity" and v.usable == ("full",) and v.room_on == ()
    assert v.free_fraction == pytest.approx(0.05)
    # Alone, it makes the fleet unavailable (an outage), never capacity or fragmentation.
    alone = judge(fleet(other), 22_000, NOW, stale_after_s=5.0, exclude=exclude)
    assert alone.cause == "unavailable" and alone.usable == () and alone.free_fraction == 0.0


def test_unavailable_names_how_many_backends_are_reachable() -> None:
    v = judge(fleet(node("a", up=False), node("b", up=False), node("c", draining=True)), 100, NOW)
    assert v.cause == "unavailable" and v.reachable == 1 and v.total == 3
    assert "1 of 3 reachable" in v.message and "down: a, b" in v.message


def test_fragmentation_is_one_node_with_room_not_memory_spread_over_nodes() -> None:
    spread = fleet(node("a", free=15_000, largest=2_000), node("b", free=15_000, largest=2_000))
    assert nothing_fits_reason(spread, 22_000, NOW)[0] == "capacity"
    one = fleet(node("a", free=30_000, largest=2_000), node("b", free=5_000))
    v = judge(one, 22_000, NOW)
    assert v.cause == "fragmentation" and v.room_on == ("a",)


def test_pending_reservations_count_against_room() -> None:
    v = judge(fleet(node("a", free=30_000, largest=2_000, pending_tokens=10_000)), 22_000, NOW)
    assert v.cause == "capacity"


def test_the_local_overlay_counts_reservations_until_a_snapshot_shows_them() -> None:
    local = LocalReservations()
    snap = fleet(node("a"), node("b"))
    local.add("a", "r1", 1_000)
    seen = local.apply(snap).by_name()["a"].overlay
    assert (seen.pending_tokens, seen.inflight) == (1_000, 1)
    local.confirm("a", "r1", NOW - 1)  # confirmed before this snapshot was read: it shows it
    assert local.apply(snap).by_name()["a"].overlay.inflight == 0
    local.confirm("a", "r1", NOW + 1)  # after: not in this snapshot yet
    assert local.apply(snap).by_name()["a"].overlay.inflight == 1
    local.remove("a", "r1")
    assert local.count() == 0 and local.apply(snap) is snap


def test_a_retry_key_entry_is_lifted_by_a_newer_report_with_room() -> None:
    failed_at = NOW - 1
    items = {retry_memory.entry("a", failed_at), retry_memory.entry("b", failed_at), "c"}
    snap = fleet(
        node("a", free=30_000),  # newer, room for it: lifted
        node("b", free=30_000, largest=5_000),  # newer, still no block: kept
        node("c", free=30_000),  # a bare name (no time): kept
    )
    assert retry_memory.still_excluded(items, snap, 20_000) == {"b", "c"}
    older = fleet(node("a", free=30_000, age=5.0))  # the report predates the failure
    assert retry_memory.still_excluded(items, older, 20_000) == {"a", "b", "c"}
    assert retry_memory.parse("name@notatime") == ("name@notatime", None)
