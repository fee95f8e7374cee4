"""Held requests are overtaken a bounded number of times (proxy.core.aging)."""

from __future__ import annotations

from proxy.core.aging import HeldOrder


def test_newer_requests_overtake_a_held_one_only_up_to_the_limit() -> None:
    order = HeldOrder(max_overtakes=2)
    order.hold("long")
    for i in range(2):
        assert order.may_place(f"short{i}")
        order.placed(f"short{i}")
    # Overtaken twice, no node named yet: nothing newer passes, neither new arrivals nor
    # later holds.
    assert not order.may_place("short2")
    order.hold("short3")
    assert not order.may_place("short3")
    assert order.starving() == 1 and order.needs_target("long")
    # The long request itself may go; then the line moves again.
    assert order.may_place("long") and order.kept("long") == frozenset()
    order.placed("long")
    assert order.may_place("short3") and order.starving() == 0


def test_a_starving_request_keeps_one_node_and_newer_ones_take_the_others() -> None:
    order = HeldOrder(max_overtakes=1)
    order.hold("doc")
    order.placed("chat0")
    order.keep("doc", "n1")
    assert not order.needs_target("doc") and order.target("doc") == "n1"
    # Newer requests place again, anywhere but n1; the doc itself may use every node.
    assert order.may_place("chat1") and order.kept("chat1") == frozenset({"n1"})
    assert order.kept("doc") == frozenset()
    # A second starving request keeps its own node; the newest leaves both alone.
    order.hold("doc2")
    order.placed("chat2")
    order.keep("doc2", "n2")
    assert order.kept("doc2") == frozenset({"n1"})
    assert order.kept("chat3") == frozenset({"n1", "n2"})
    order.placed("doc")
    assert order.kept("chat3") == frozenset({"n2"})


def test_older_requests_are_not_held_back_by_newer_ones() -> None:
    order = HeldOrder(max_overtakes=0)
    order.hold("old")
    order.hold("new")
    assert order.may_place("old")
    order.placed("old")
    assert order.may_place("new")
    assert len(order) == 1


def test_a_request_that_leaves_frees_the_line() -> None:
    order = HeldOrder(max_overtakes=1)
    order.hold("long")
    order.placed("short")
    assert not order.may_place("other")
    order.gone("long")
    assert order.may_place("other") and len(order) == 0


def test_holding_again_keeps_the_first_place_in_line() -> None:
    order = HeldOrder(max_overtakes=1)
    order.hold("a")
    order.hold("b")
    order.hold("a")  # a second wait of the same request: still ahead of b
    order.placed("c")
    assert order.may_place("a") and not order.may_place("b")


def test_a_newer_request_that_ends_before_the_kept_room_frees_may_take_that_node() -> None:
    order = HeldOrder(max_overtakes=0)
    order.hold("doc")
    # Its node's room frees in 300 decode steps.
    order.keep("doc", "n1", free_in=300)
    assert order.kept("chat", steps=100) == frozenset()  # ends first: backfilled
    assert order.kept("essay", steps=300) == frozenset({"n1"})  # would still hold room then
    assert order.kept("unknown") == frozenset({"n1"})  # no expected length: kept from it
