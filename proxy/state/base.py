"""The state store interface shared by the Redis store and the embedded in-process store.

Both implementations pass one contract suite (tests/state/test_state_contract.py). Times are
passed in by the caller (unix seconds) so that behaviour is deterministic under test and
identical between the two stores. Times that cross replicas (reservation, report, ceiling
and cooldown times) are on the store's clock: ``StateStore.now()`` is this host's clock plus
``clock_offset``, which the Redis store measures against Redis ``TIME`` (``sync_clock``), so
a replica whose clock is off still compares like with like. The embedded store's offset is 0.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from proxy.core.fleet import MemoryReport, Overlay
from proxy.core.lazy import lazy_headroom

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import StoreUnavailable as StoreUnavailable

if TYPE_CHECKING:
    from proxy.state.lease import Lease, LeaseRound

Status = Literal["up", "down", "unknown"]


@dataclass(frozen=True, slots=True)
class Reservation:
    """An in-flight request's claim on a backend's KV memory; expires on its own."""

    id: str
    tokens: int
    created_at: float
    expires_at: float
    #: The lease id of the replica that holds it ("" for none: counts until it expires).
    replica: str = ""


@dataclass(frozen=True, slots=True)
class Flags:
    draining: bool = False
    cooldown_until: float = 0.0
    ceiling_tokens: int | None = None
    ceiling_set_at: float = 0.0
    ceiling_until: float = 0.0


@dataclass(frozen=True, slots=True)
class BackendState:
    """Everything the store holds about one backend, read in one go."""

    name: str
    status: Status = "unknown"
    status_reason: str = ""
    report: MemoryReport | None = None
    reservations: tuple[Reservation, ...] = ()
    flags: Flags = field(default_factory=Flags)

    def overlay(self, now: float, grace_s: float) -> Overlay:
        return build_overlay(self.report, self.reservations, self.flags, now, grace_s)


def pending_tokens(
    report: MemoryReport | None,
    reservations: tuple[Reservation, ...] | list[Reservation],
    now: float,
    grace_s: float,
) -> int:
    """Tokens reserved after the report was taken (minus a grace), i.e. not yet visible in it.

    Reservations older than the report are already allocated on the backend and counted in
    its free/largest-block figures; counting them again would double count.
    """
    return pending_and_reserved(report, reservations, now, grace_s)[0]


def pending_and_reserved(
    report: MemoryReport | None, reservations: Iterable[Reservation], now: float, grace_s: float
) -> tuple[int, int]:
    """``pending_tokens`` and the tokens of every live reservation, in one pass.

    The reserve's fit check needs both (the second for a lazily allocating server); one
    pass, since the embedded store runs it on every request over every reservation held.
    """
    cutoff = (report.reported_at - grace_s) if report is not None else float("-inf")
    pending = reserved = 0
    for r in reservations:
        if r.expires_at > now:
            reserved += r.tokens
            if r.created_at >= cutoff:
                pending += r.tokens
    return pending, reserved


def live_reservations(reservations: Iterable[Reservation], now: float) -> tuple[Reservation, ...]:
    """Unexpired reservations in a canonical order (oldest first, then id), so both stores agree."""
    return tuple(
        sorted((r for r in reservations if r.expires_at > now), key=lambda r: (r.created_at, r.id))
    )


def ceiling_in_force(flags: Flags, report: MemoryReport | None, now: float) -> int | None:
    """The learned ceiling that still applies, or None once it expired or a newer report lifted it.

    A learned ceiling is lifted by a report taken after it was set that shows a free block
    big enough again (the node freed memory or restarted).
    """
    ceiling = flags.ceiling_tokens
    if ceiling is None or now >= flags.ceiling_until:
        return None
    if (
        report is not None
        and report.reported_at > flags.ceiling_set_at
        and report.largest_free_block_tokens >= ceiling
    ):
        return None
    return ceiling


def merge_ceiling(
    flags: Flags, report: MemoryReport | None, tokens: int, now: float, until: float
) -> Flags:
    """set_ceiling's rule: the lowest ceiling still in force wins.

    A lower (or the first) ceiling replaces the one in force; the same ceiling learned again
    is refreshed (later set_at/until); a higher one adds nothing, since "cannot fit N" already
    implies "cannot fit more than N". The Redis store runs the same rule in Lua.
    """
    current = ceiling_in_force(flags, report, now)
    if current is None or tokens < current:
        return replace(flags, ceiling_tokens=tokens, ceiling_set_at=now, ceiling_until=until)
    if tokens == current:
        return replace(
            flags,
            ceiling_set_at=max(flags.ceiling_set_at, now),
            ceiling_until=max(flags.ceiling_until, until),
        )
    return flags


_PLAIN_NUMBERS = frozenset({int, float})


def check_finite(**values: float) -> None:
    """Reject NaN/infinite times and sizes: Redis and Python would order them differently."""
    for label, value in values.items():
        # A plain int or float (nearly always): one type test, not three (per store call).
        if type(value) in _PLAIN_NUMBERS:
            if not math.isfinite(value):
                raise ValueError(f"{label} must be a finite number, got {value!r}")
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{label} must be a finite number, got {value!r}")


def check_ttl(ttl_s: float) -> None:
    check_finite(ttl_s=ttl_s)
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")


def check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")


def check_reserve_args(
    tokens: int, now: float, ttl_s: float, headroom: float, grace_s: float
) -> None:
    """Reject arguments both stores would otherwise treat differently (negative, NaN, infinite)."""
    check_tokens(tokens)
    # ``check_ttl``, folded into the one finiteness pass (every reserve runs this).
    check_finite(now=now, headroom=headroom, grace_s=grace_s, ttl_s=ttl_s)
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
    if headroom < 0 or grace_s < 0:
        raise ValueError(f"headroom and grace_s must be >= 0, got {headroom!r}, {grace_s!r}")


def build_overlay(
    report: MemoryReport | None,
    reservations: tuple[Reservation, ...] | list[Reservation],
    flags: Flags,
    now: float,
    grace_s: float,
) -> Overlay:
    live = [r for r in reservations if r.expires_at > now]
    ceiling = ceiling_in_force(flags, report, now)
    return Overlay(
        pending_tokens=pending_tokens(report, live, now, grace_s),
        reserved_tokens=sum(r.tokens for r in live),
        inflight=len(live),
        draining=flags.draining,
        cooldown_until=flags.cooldown_until,
        ceiling_tokens=ceiling,
        ceiling_until=flags.ceiling_until if ceiling is not None else 0.0,
    )


def reservation_fits(
    report: MemoryReport | None, pending: int, tokens: int, headroom: float, reserved: int = 0
) -> bool:
    """The atomic reserve's check: pending + demand x (1 + headroom) within the largest free block.

    For a lazily allocating server (``report.queueing``) the demand must instead fit beside
    every live reservation at its full demand (``reserved``; ``proxy.core.lazy``), since
    its report shows only what is already cached; where the report ``counts_flights``, it
    must fit both ways (``NodeView.usable_block``). A demand the server queues rather than
    refuses (``queued_up_to_tokens``: llama.cpp's partitioned slots) is always allowed, as
    ``NodeView.fits`` allows it. With no report there is nothing to check against, so the
    reservation is allowed.
    """
    if report is None:
        return True
    need = tokens * (1.0 + headroom)
    if need <= report.queued_up_to_tokens:
        return True
    if report.queueing:
        return need <= lazy_headroom(report, reserved)
    if pending + need > report.largest_free_block_tokens:
        return False
    # A server that shows a request late (llama.cpp): every live reservation counts too.
    return not report.counts_flights or need <= lazy_headroom(report, reserved)


class StateStore(abc.ABC):
    """Per-backend reported state, the gateway's overlay, retry memory, locks and events."""

    #: Seconds to add to this host's clock to get the store's clock (see ``now``).
    clock_offset: float = 0.0
    #: This replica's lease (``hold_lease``); None: reservations carry no replica id.
    lease: Lease | None = None

    # --- the shared clock ---
    def now(self) -> float:
        """Unix time on the store's clock: use it for every time another replica compares."""
        return time.time() + self.clock_offset

    async def sync_clock(self) -> float:
        """Measure ``clock_offset`` again; returns it. One process's store has nothing to sync."""
        return self.clock_offset

    @property
    def degraded(self) -> bool:
        """True while a shared store is unreachable and this replica runs on local state."""
        return False

    # --- reports (written by the collector, or pushed by custom servers into Redis) ---
    @abc.abstractmethod
    async def put_report(self, name: str, report: MemoryReport, ttl_s: float) -> None:
        """Store a backend's memory report and mark it up; the report expires after ttl_s."""

    @abc.abstractmethod
    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        """Mark a backend unreachable (keeps the last report for diagnosis)."""

    @abc.abstractmethod
    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        """Read the full state of these backends in one round trip; unknown names come back empty."""

    @abc.abstractmethod
    async def known_backends(self) -> set[str]:
        """Names of every backend that has ever reported (including ones pushed directly)."""

    # --- reservations ---
    @abc.abstractmethod
    async def reserve(
        self,
        name: str,
        reservation_id: str,
        tokens: int,
        now: float,
        ttl_s: float,
        *,
        check_fit: bool = True,
        headroom: float = 0.0,
        grace_s: float = 0.0,
    ) -> bool:
        """Atomically add a reservation; with check_fit, only if it fits (see reservation_fits)."""

    @abc.abstractmethod
    async def release(self, name: str, reservation_id: str) -> None:
        """Remove a reservation; releasing an unknown id is a no-op."""

    async def release_many(self, items: list[tuple[str, str]]) -> None:
        """Release several (backend, reservation id) pairs; a shared store sends them in one
        round trip. This default releases them one by one."""
        for name, reservation_id in items:
            await self.release(name, reservation_id)

    async def shrink(self, name: str, reservation_id: str, tokens: int) -> bool:
        """Lower a live reservation to ``tokens``, keeping its times; True when it was lowered.

        For a request placed on an upper bound of its size whose exact count arrived later
        (``proxy.gateway.bound_route``). Never raises one, never re-creates a reservation
        that was released (a shrink that arrives after its release changes nothing). This
        default changes nothing: the reservation keeps its size until released, which over-
        counts but never over-commits.
        """
        check_tokens(tokens)
        return False

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        """Release, and refuse this id until ``until`` (store clock); idempotent.

        For a reserve whose outcome is unknown (timed out, or its request was cancelled while
        it was in flight): a plain release can reach the store before that reserve does and
        then leaves it behind; after ``forget`` the late reserve is refused. This default
        (a plain release) is for stores where a call cannot arrive late.
        """
        await self.release(name, reservation_id)

    @abc.abstractmethod
    async def reservations(self, name: str, now: float) -> list[Reservation]:
        """Live (unexpired) reservations on a backend."""

    # --- flags ---
    @abc.abstractmethod
    async def set_draining(self, name: str, draining: bool) -> None: ...

    @abc.abstractmethod
    async def set_cooldown(self, name: str, until: float) -> None: ...

    @abc.abstractmethod
    async def set_ceiling(self, name: str, tokens: int, now: float, until: float) -> None:
        """Learn that `name` cannot fit `tokens` (or more) now; keeps the lowest active ceiling."""

    # --- retry memory ---
    @abc.abstractmethod
    async def add_failed(self, retry_key: str, name: str, ttl_s: float) -> None: ...

    @abc.abstractmethod
    async def failed_on(self, retry_key: str) -> set[str]: ...

    # --- coordination between gateway replicas ---
    @abc.abstractmethod
    async def try_lock(self, lock: str, owner: str, ttl_s: float) -> bool:
        """Take or extend (when already ours) a lock with expiry."""

    @abc.abstractmethod
    async def unlock(self, lock: str, owner: str) -> None: ...

    # --- maintenance event log ---
    @abc.abstractmethod
    async def append_event(self, event: dict[str, Any], max_len: int = 1000) -> None: ...

    @abc.abstractmethod
    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first."""

    # --- replica leases (proxy.state.lease) ---
    def hold_lease(self, lease: Lease) -> None:
        """From now on every reservation carries ``lease``'s id and counts while it is renewed."""
        self.lease = lease

    async def renew_lease(self, now: float) -> LeaseRound:
        """Renew this replica's lease (register anew if it lapsed), sweep lapsed ones."""
        raise NotImplementedError(f"{type(self).__name__} holds no leases")

    async def live_leases(self, now: float) -> dict[str, float]:
        """Every replica's lease still live at ``now``: id -> the time it runs to."""
        return {}

    # --- lifecycle ---
    @abc.abstractmethod
    async def ping(self) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
