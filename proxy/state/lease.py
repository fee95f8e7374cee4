"""Replica leases: a replica that dies takes its reservations with it (issue 51).

Each gateway replica (each worker under ``--workers``) holds a lease in the shared store: an
id, ``<base>.<epoch>``, and a time it runs to (store clock), renewed every third of
``store.lease_ttl_s`` by ``proxy.state.lease_task``. Every reservation it makes carries the id
(the reservation's field is ``<reservation id>@<lease id>``), and the backend's
``:leases`` hash, in the backend's own hash slot, holds the time each lease runs to. A
reservation whose lease has lapsed stops counting at once, for every replica: the reserve
script and the fleet read both skip it, so no replica has to be alive for that to happen.
Whichever replica renews next removes the lapsed lease from the lease set (exactly one
does: one atomic script) and sweeps its reservations out of every backend.

A replica whose lease lapsed while it lived (frozen, cut off from Redis for longer than the
TTL) takes a new epoch and re-asserts what it still holds under it (``on_new``); what its
old life sends late (a release, a forget, a reserve) writes or deletes fields of the old
id, which no longer count. Reservations without an id (older gateways during a rolling
upgrade, a store with no lease held) count as before, until their own expiry.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, TypeVar

#: Between a reservation id and its lease id in the store's field name (its first "@").
LEASE_SEP = "@"
#: What a lease id this gateway makes may contain (never the separator).
_LEASE_ID = re.compile(r"[A-Za-z0-9._-]+")


def lease_field(reservation_id: str, lease: str) -> str:
    """The store field of a reservation: its id, and its lease's id when it has one."""
    return f"{reservation_id}{LEASE_SEP}{lease}" if lease else reservation_id


@lru_cache(maxsize=16384)
def split_field(field: str) -> tuple[str, str]:
    """(reservation id, lease id or "") of a store field; the twin of the Lua match.

    Memoised like redis_codec's parsing: every fleet read sees the same fields again."""
    rid, sep, lease = field.partition(LEASE_SEP)
    if sep and rid and lease:
        return rid, lease
    return field, ""


class HeldBy(Protocol):
    """What ``counting`` reads of a reservation (``proxy.state.base.Reservation``): its
    replica's lease id. A protocol, so this module need not import the store's base."""

    @property
    def replica(self) -> str: ...


HeldT = TypeVar("HeldT", bound=HeldBy)


def counting(reservations: Iterable[HeldT], leases: Mapping[str, float], now: float) -> list[HeldT]:
    """The reservations that still count: those without a lease, and those whose lease
    runs past ``now`` on this backend."""
    return [r for r in reservations if not r.replica or leases.get(r.replica, -math.inf) > now]


@dataclass(frozen=True, slots=True)
class LeaseRound:
    """What one renewal did."""

    lease: str
    #: The lease was (re)registered under a new id: first round, or the last one had lapsed.
    new: bool
    #: Other replicas' leases this round found lapsed and removed (each found by one replica).
    lapsed: tuple[str, ...] = ()
    #: Their live reservations swept out, and those reservations' tokens.
    dropped: int = 0
    dropped_tokens: int = 0


# Earlier ids of ours a release still deletes under (``Lease.recent``).
RECENT_IDS = 3


class Lease:
    """This replica's lease: its current id, the time it runs to, and its epoch."""

    def __init__(self, base: str, ttl_s: float) -> None:
        if not _LEASE_ID.fullmatch(base) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"lease: bad base id {base!r} or ttl_s {ttl_s!r}")
        self.base = base
        self.ttl_s = ttl_s
        self.epoch = 0
        self.id = ""
        self.until = -math.inf
        # The current id is in the store's lease set (a renewal extends it rather than adds it).
        self.registered = False
        self.on_new: list[Callable[[str], None]] = []
        # Our own ids of earlier epochs, whose reservations the next renewal sweeps (the
        # ledger re-asserts what is still held under the new id; a release finds only that).
        self.retired: list[str] = []
        # The last few ids, kept after their sweep: a release deletes a reservation under
        # each (one that a replay or a re-assert wrote under an id about to retire, and that
        # the sweep missed, would otherwise outlive its request; seen once in the fault
        # suite, a Redis kill under load).
        self.recent: deque[str] = deque(maxlen=RECENT_IDS)

    def current(self, now: float) -> str:
        """The id a reservation made ``now`` carries: a new one when the lease has lapsed."""
        if now >= self.until:
            self.next_epoch(now)
        return self.id

    def next_epoch(self, now: float) -> None:
        """Register anew: reservations of the old id stop counting, ours are re-asserted."""
        if self.id:
            self.retired.append(self.id)
            self.recent.append(self.id)
        self.epoch += 1
        self.id = f"{self.base}.{self.epoch}"
        self.until = now + self.ttl_s
        self.registered = False
        for callback in self.on_new:
            callback(self.id)

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (store clock) was written."""
        self.until = sent_at + self.ttl_s
        self.registered = True
