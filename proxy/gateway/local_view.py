"""This replica's own reservations, applied at once to the fleet view it ranks on.

Ranking reads a cached snapshot (one store read per ``refresh_s`` shared by every request),
so a burst of requests used to rank on the same figures and pick the same node: 24 short
requests to 4 idle engines landed 11/13/0/0. The store's atomic reserve prevents
over-commitment, not pile-ups. Here every reservation this replica makes is counted on its
node from the moment it is attempted (before the store's answer), until it is released or a
snapshot read after it was confirmed shows it (then the store's overlay counts it, and
counting it here too would count it twice). A reservation whose store call failed (the store
is unreachable) stays counted here until it ends: the replica's view stays its own best guess.

Every request ranks on this view, so it is kept as running sums per backend rather than
walked: walking every reservation in flight made each request's cost grow with the
concurrency (at 64 connections it was 3% of the gateway's CPU). A confirmed reservation
leaves the sums once a snapshot read after its confirmation is applied (a heap by
confirmation time); a view of an older snapshot than the newest applied is walked as before.

The other way round, a reservation released here stays in every snapshot read after its
confirmation and before its release (``FleetCache`` serves a snapshot up to ``stale_s`` old
while the next read runs). Counted there, it made the room it held look taken, and on a
lazily allocating node the projection took it for another replica's reservation
(``MemoryPressure._foreign``). So a released reservation is taken out of such a snapshot:
from its reserved tokens and count, and from its pending tokens when it was made after the
snapshot's report (made within the store's grace before it, it stays: the conservative
side). Kept until a snapshot read after the release is applied.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.core.fleet import FleetSnapshot, NodeView


@dataclass(slots=True, eq=False)
class _Local:
    tokens: int
    # The fleet cache's clock when the store confirmed it; None until then (or never).
    confirmed_at: float | None = None
    # When it was made, as the store records it (pending against reports older than that).
    created_at: float | None = None
    # In its backend's running sums: not confirmed, or confirmed no earlier than the newest
    # snapshot applied (which cannot show it yet).
    counted: bool = True


@dataclass(slots=True)
class _Backend:
    entries: dict[str, _Local] = field(default_factory=dict)
    tokens: int = 0
    count: int = 0
    # The newest snapshot time applied: confirmed entries before it are out of the sums.
    seen: float = float("-inf")
    # Confirmed entries by confirmation time (ties in order): (at, seq, entry). An item
    # whose entry was confirmed again since, or is gone, is skipped when it comes up.
    confirmed: list[tuple[float, int, _Local]] = field(default_factory=list)
    # Confirmed reservations released here, in release order: (released at, entry). A
    # snapshot read between its confirmation and its release still shows it.
    released: list[tuple[float, _Local]] = field(default_factory=list)

    def uncount(self, e: _Local) -> None:
        if e.counted:
            e.counted = False
            self.tokens -= e.tokens
            self.count -= 1

    def advance(self, taken_at: float) -> None:
        """Apply a snapshot read at ``taken_at`` (not older than ``seen``): it shows what was
        confirmed before it."""
        self.seen = taken_at
        if self.released and self.released[0][0] < taken_at:
            # Released before this read: no snapshot applied from now on shows them.
            self.released = [item for item in self.released if item[0] >= taken_at]
        heap = self.confirmed
        while heap and heap[0][0] < taken_at:
            at, _, e = heapq.heappop(heap)
            if e.confirmed_at == at:  # not confirmed again at another time since
                self.uncount(e)

    def walked(self, taken_at: float) -> tuple[int, int]:
        """The sums for an older snapshot than ``seen``, walked (the view as it was then)."""
        tokens = count = 0
        for e in self.entries.values():
            if e.confirmed_at is None or e.confirmed_at >= taken_at:
                tokens += e.tokens
                count += 1
        return tokens, count


class LocalReservations:
    """Reservations in flight through this replica, by backend and reservation id.

    ``clock``: the fleet cache's (the store's time, as snapshots are stamped); releases are
    laid over the snapshots read before them only with one.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._by_backend: dict[str, _Backend] = {}
        self._seq = itertools.count()
        self.clock = clock

    def add(self, backend: str, reservation_id: str, tokens: int) -> None:
        b = self._by_backend.get(backend)
        if b is None:
            b = self._by_backend[backend] = _Backend()
        old = b.entries.get(reservation_id)
        if old is not None:
            b.uncount(old)
        b.entries[reservation_id] = _Local(tokens)
        b.tokens += tokens
        b.count += 1

    def confirm(
        self, backend: str, reservation_id: str, at: float, created_at: float | None = None
    ) -> None:
        b = self._by_backend.get(backend)
        e = b.entries.get(reservation_id) if b is not None else None
        if b is None or e is None:
            return
        e.confirmed_at = at  # a later confirmation replaces an earlier one
        e.created_at = created_at
        if at < b.seen:
            b.uncount(e)  # a snapshot newer than its confirmation is applied already
        else:
            if not e.counted:
                e.counted = True
                b.tokens += e.tokens
                b.count += 1
            heapq.heappush(b.confirmed, (at, next(self._seq), e))
            if len(b.confirmed) > 2 * len(b.entries) + 64:
                # Entries removed before a snapshot passed them: drop them from the heap.
                b.confirmed = [
                    item
                    for item in b.confirmed
                    if item[2].counted and item[2].confirmed_at == item[0]
                ]
                heapq.heapify(b.confirmed)

    def shrink(self, backend: str, reservation_id: str, tokens: int) -> None:
        """Count a reservation at its lowered size (``ReservationLedger.shrink``)."""
        b = self._by_backend.get(backend)
        e = b.entries.get(reservation_id) if b is not None else None
        if b is None or e is None or tokens >= e.tokens:
            return
        if e.counted:
            b.tokens -= e.tokens - tokens
        e.tokens = tokens

    def remove(self, backend: str, reservation_id: str) -> None:
        b = self._by_backend.get(backend)
        if b is None:
            return
        e = b.entries.pop(reservation_id, None)
        if e is not None:
            b.uncount(e)
            if e.confirmed_at is not None and self.clock is not None:
                b.released.append((self.clock(), e))
        if not b.entries and not b.released:
            del self._by_backend[backend]

    def count(self) -> int:
        return sum(len(b.entries) for b in self._by_backend.values())

    def apply(self, snap: FleetSnapshot) -> FleetSnapshot:
        """``snap`` with this replica's reservations that it cannot show yet added as pending."""
        held = self._by_backend
        if not held:
            return snap
        taken_at = snap.taken_at
        nodes = tuple([self._apply_one(n, taken_at) if n.name in held else n for n in snap.nodes])
        return FleetSnapshot(nodes, taken_at=taken_at)

    def _apply_one(self, n: NodeView, taken_at: float) -> NodeView:
        b = self._by_backend[n.name]
        if taken_at >= b.seen:
            b.advance(taken_at)
            tokens, count = b.tokens, b.count
        else:
            tokens, count = b.walked(taken_at)
        pending = tokens
        if b.released:
            gone, gone_pending, n_gone = _released_in(b.released, taken_at, n)
            tokens, pending, count = tokens - gone, pending - gone_pending, count - n_gone
        elif not b.entries:
            del self._by_backend[n.name]
        if not count and not tokens:
            return n
        ov = n.overlay
        # Never below nothing: the store may already have dropped one (its TTL).
        tokens, pending = max(tokens, -ov.reserved_tokens), max(pending, -ov.pending_tokens)
        return n.with_overlay(ov.plus_pending(tokens, max(count, -ov.inflight), pending))


def _released_in(
    released: list[tuple[float, _Local]], taken_at: float, n: NodeView
) -> tuple[int, int, int]:
    """Tokens, pending tokens and count of the reservations released here that a snapshot
    read at ``taken_at`` still shows (confirmed before it, released after it)."""
    reported_at = n.report.reported_at if n.report is not None else float("-inf")
    tokens = pending = count = 0
    for released_at, e in released:
        confirmed = e.confirmed_at
        if confirmed is not None and confirmed < taken_at <= released_at:
            tokens += e.tokens
            count += 1
            if e.created_at is not None and e.created_at >= reported_at:
                pending += e.tokens
    return tokens, pending, count
