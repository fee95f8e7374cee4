"""proxy.gateway.local_view: the running sums give the view a walk of every reservation gives.

The reference below is the walk the sums replaced: each reservation counts on its node unless
the store confirmed it before the snapshot was read. Random sequences of what the walk does
to reservations (add, confirm, shrink, remove) and of snapshots read at any time, older ones
included, must give the same pending tokens and counts on every node.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.gateway.local_view import LocalReservations

NODES = ("a", "b")


@dataclass
class _Ref:
    tokens: int
    confirmed_at: float | None = None


class Walked:
    """The walk over every reservation, as the view was computed before the sums."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, _Ref]] = {}

    def add(self, backend: str, rid: str, tokens: int) -> None:
        self.held.setdefault(backend, {})[rid] = _Ref(tokens)

    def confirm(self, backend: str, rid: str, at: float) -> None:
        e = self.held.get(backend, {}).get(rid)
        if e is not None:  # a later confirmation replaces an earlier one
            e.confirmed_at = at

    def shrink(self, backend: str, rid: str, tokens: int) -> None:
        e = self.held.get(backend, {}).get(rid)
        if e is not None:
            e.tokens = min(e.tokens, tokens)

    def remove(self, backend: str, rid: str) -> None:
        self.held.get(backend, {}).pop(rid, None)

    def pending(self, backend: str, taken_at: float) -> tuple[int, int]:
        tokens = count = 0
        for e in self.held.get(backend, {}).values():
            if e.confirmed_at is None or e.confirmed_at >= taken_at:
                tokens += e.tokens
                count += 1
        return tokens, count


def snapshot(taken_at: float) -> FleetSnapshot:
    report = MemoryReport(100_000, 100_000, 100_000, reported_at=taken_at)
    nodes = tuple(NodeView(name=n, report=report, overlay=Overlay()) for n in NODES)
    return FleetSnapshot(nodes, taken_at=taken_at)


op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(NODES), st.integers(0, 2), st.integers(1, 900)),
    st.tuples(st.just("confirm"), st.sampled_from(NODES), st.integers(0, 2), st.integers(0, 8)),
    st.tuples(st.just("shrink"), st.sampled_from(NODES), st.integers(0, 2), st.integers(0, 900)),
    st.tuples(st.just("remove"), st.sampled_from(NODES), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("view"), st.just("a"), st.just(0), st.integers(0, 8)),
)


@settings(max_examples=600, deadline=None)
@given(st.lists(op, max_size=40))
# Confirmed after a newer snapshot was applied; shrunk while counted.
@example([("add", "a", 0, 500), ("view", "a", 0, 8), ("confirm", "a", 0, 5), ("view", "a", 0, 8)])
@example([("add", "a", 0, 500), ("shrink", "a", 0, 100), ("view", "a", 0, 1)])
# Confirmed again, later: counted again until a snapshot passes the new time.
@example(
    [
        ("add", "a", 0, 9),
        ("confirm", "a", 0, 1),
        ("view", "a", 0, 4),
        ("confirm", "a", 0, 6),
        ("view", "a", 0, 4),
    ]
)
def test_the_sums_give_what_walking_every_reservation_gives(
    ops: list[tuple[str, str, int, int]],
) -> None:
    local, ref = LocalReservations(), Walked()
    for kind, backend, rid_n, value in ops:
        rid = f"r{rid_n}"
        if kind == "add":
            local.add(backend, rid, value)
            ref.add(backend, rid, value)
        elif kind == "confirm":
            local.confirm(backend, rid, float(value))
            ref.confirm(backend, rid, float(value))
        elif kind == "shrink":
            local.shrink(backend, rid, value)
            ref.shrink(backend, rid, value)
        elif kind == "remove":
            local.remove(backend, rid)
            ref.remove(backend, rid)
        else:
            taken_at = float(value)
            view = local.apply(snapshot(taken_at))
            for n in view.nodes:
                want = ref.pending(n.name, taken_at)
                assert (n.overlay.pending_tokens, n.overlay.inflight) == want, (n.name, taken_at)
    assert local.count() == sum(len(held) for held in ref.held.values())


def test_a_reservation_confirmed_before_the_snapshot_leaves_the_view_once_it_is_read() -> None:
    local = LocalReservations()
    local.add("a", "r1", 500)
    assert local.apply(snapshot(1.0)).nodes[0].overlay.pending_tokens == 500
    local.confirm("a", "r1", 2.0)
    # A snapshot read before the confirmation cannot show it: still counted here.
    assert local.apply(snapshot(1.5)).nodes[0].overlay.pending_tokens == 500
    # One read after it shows it in the store's overlay: not counted twice.
    assert local.apply(snapshot(3.0)).nodes[0].overlay.pending_tokens == 0
    # A request still ranking on an older snapshot sees it as that snapshot could not.
    assert local.apply(snapshot(1.5)).nodes[0].overlay.pending_tokens == 500
