"""This replica's own reservations, applied at once to the fleet view it ranks on.

Ranking reads a cached snapshot (one store read per ``refresh_s`` shared by every request),
so a burst of requests used to rank on the same figures and pick the same node: 24 short
requests to 4 idle engines landed 11/13/0/0. The store's atomic reserve prevents
over-commitment, not pile-ups. Here every reservation this replica makes is counted on its
node from the moment it is attempted (before the store's answer), until it is released or a
snapshot read after it was confirmed shows it (then the store's overlay counts it, and
counting it here too would count it twice). A reservation whose store call failed (the store
is unreachable) stays counted here until it ends: the replica's view stays its own best guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.core.fleet import FleetSnapshot, NodeView


@dataclass(slots=True)
class _Local:
    tokens: int
    # The fleet cache's clock when the store confirmed it; None until then (or never).
    confirmed_at: float | None = None


class LocalReservations:
    """Reservations in flight through this replica, by backend and reservation id."""

    def __init__(self) -> None:
        self._by_backend: dict[str, dict[str, _Local]] = {}

    def add(self, backend: str, reservation_id: str, tokens: int) -> None:
        self._by_backend.setdefault(backend, {})[reservation_id] = _Local(tokens)

    def confirm(self, backend: str, reservation_id: str, at: float) -> None:
        entry = self._by_backend.get(backend, {}).get(reservation_id)
        if entry is not None:
            entry.confirmed_at = at

    def shrink(self, backend: str, reservation_id: str, tokens: int) -> None:
        """Count a reservation at its lowered size (``ReservationLedger.shrink``)."""
        entry = self._by_backend.get(backend, {}).get(reservation_id)
        if entry is not None:
            entry.tokens = min(entry.tokens, tokens)

    def remove(self, backend: str, reservation_id: str) -> None:
        held = self._by_backend.get(backend)
        if held is not None:
            held.pop(reservation_id, None)
            if not held:
                del self._by_backend[backend]

    def count(self) -> int:
        return sum(len(held) for held in self._by_backend.values())

    def apply(self, snap: FleetSnapshot) -> FleetSnapshot:
        """``snap`` with this replica's reservations that it cannot show yet added as pending."""
        held = self._by_backend
        if not held:
            return snap
        taken_at = snap.taken_at
        nodes = tuple([self._apply_one(n, taken_at) if n.name in held else n for n in snap.nodes])
        return FleetSnapshot(nodes, taken_at=taken_at)

    def _apply_one(self, n: NodeView, taken_at: float) -> NodeView:
        # One pass, no list (every request walks every reservation in flight here).
        tokens = count = 0
        for e in self._by_backend[n.name].values():
            # Confirmed before the snapshot was read: the store's overlay shows it already.
            if e.confirmed_at is None or e.confirmed_at >= taken_at:
                tokens += e.tokens
                count += 1
        if not count:
            return n
        return n.with_overlay(n.overlay.plus_pending(tokens, count))
