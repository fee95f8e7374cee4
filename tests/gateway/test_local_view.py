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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Stored:
    tokens: int
    confirmed_at: float | None = None
    released_at: float | None = None


def store_view(held: dict[str, _Stored], taken_at: float) -> FleetSnapshot:
    """What the store shows at ``taken_at``: confirmed before it, not released by then.

    Every reservation counts as pending (the report is older than all of them)."""
    shown = [
        e
        for e in held.values()
        if e.confirmed_at is not None
        and e.confirmed_at < taken_at
        and (e.released_at is None or e.released_at >= taken_at)
    ]
    tokens = sum(e.tokens for e in shown)
    report = MemoryReport(100_000, 100_000, 100_000, reported_at=-1.0)
    overlay = Overlay(tokens, tokens, len(shown))
    return FleetSnapshot((NodeView(name="a", report=report, overlay=overlay),), taken_at=taken_at)


life = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 900)),
    st.tuples(st.just("confirm"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("tick"), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("view"), st.just(0), st.integers(0, 3)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(life, max_size=40))
# Read between a reservation's confirmation and its release, served after the release.
@example([("add", 0, 500), ("confirm", 0, 0), ("tick", 0, 2), ("remove", 0, 0), ("view", 0, 1)])
def test_a_snapshot_read_before_a_release_shows_only_what_is_still_held(
    ops: list[tuple[str, int, int]],
) -> None:
    # Each snapshot is read at most ``age`` ticks ago and never older than one applied
    # before (a fleet cache serves the newest it has): this replica's view then holds
    # exactly the reservations it still holds, the released ones taken out of it.
    clock = Clock()
    local = LocalReservations(clock)
    held: dict[str, _Stored] = {}
    newest = float("-inf")
    for kind, n, value in ops:
        rid = f"r{n}"
        if kind == "add" and rid not in held:
            held[rid] = _Stored(value)
            local.add("a", rid, value)
        elif kind == "confirm" and rid in held and held[rid].released_at is None:
            held[rid].confirmed_at = clock.now
            local.confirm("a", rid, clock.now, created_at=clock.now)
        elif kind == "remove" and rid in held and held[rid].released_at is None:
            held[rid].released_at = clock.now
            local.remove("a", rid)
        elif kind == "tick":
            clock.now += value
        elif kind == "view":
            taken_at = max(newest, clock.now - value)
            newest = taken_at
            (node,) = local.apply(store_view(held, taken_at)).nodes
            alive = [e for e in held.values() if e.released_at is None]
            want = (sum(e.tokens for e in alive), len(alive))
            assert (node.overlay.reserved_tokens, node.overlay.inflight) == want
            assert node.overlay.pending_tokens == want[0]


def test_a_released_reservation_made_before_the_report_is_no_pending_to_take_out() -> None:
    # The report already shows what it allocated: the snapshot counted it as reserved only.
    clock = Clock()
    local = LocalReservations(clock)
    local.add("a", "r1", 500)
    local.confirm("a", "r1", 1.0, created_at=1.0)
    clock.now = 3.0
    local.remove("a", "r1")
    report = MemoryReport(100_000, 99_500, 99_500, reported_at=2.0)
    node = NodeView(name="a", report=report, overlay=Overlay(0, 500, 1))
    (seen,) = local.apply(FleetSnapshot((node,), taken_at=2.5)).nodes
    assert (seen.overlay.pending_tokens, seen.overlay.reserved_tokens, seen.overlay.inflight) == (
        0,
        0,
        0,
    )
