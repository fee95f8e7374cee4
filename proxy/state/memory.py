"""The embedded in-process state store: the default for a single gateway.

Plain dicts. Every method runs its critical section without an ``await`` in it, so on
one event loop each call is atomic (the reserve check-and-add cannot interleave with
another reserve). Report, retry-key and lock TTLs run on a monotonic clock (as Redis's
PEXPIRE does on the server's clock); reservations, ceilings and cooldowns use the times
passed in by the caller, exactly as the Redis store does.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson

from proxy.core.fleet import MemoryReport
from proxy.state.base import (
    BackendState,
    Flags,
    Reservation,
    StateStore,
    Status,
    check_finite,
    check_reserve_args,
    check_tokens,
    check_ttl,
    live_reservations,
    merge_ceiling,
    pending_and_reserved,
    reservation_fits,
)
from proxy.state.lease import LeaseRound, counting, lease_field

Clock = Callable[[], float]
T = TypeVar("T")


def result_now(coro: Coroutine[Any, Any, T]) -> T:
    """The value of a coroutine that never suspends (this store's calls), run here: the
    ledger's per-request path on the embedded store, without a task or an await."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coro.close()
    raise RuntimeError("an embedded store call suspended")


@dataclass(slots=True)
class _Entry:
    """The per-backend state hash: report and status expire together, as one Redis key does."""

    report: MemoryReport | None
    status: Status
    reason: str
    expires_at: float  # on the store's clock


class InProcessStore(StateStore):
    """One gateway's state in memory; shares nothing with other processes."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _Entry] = {}
        self._known: set[str] = set()
        self._res: dict[str, dict[str, Reservation]] = {}
        self._tombs: dict[str, dict[str, float]] = {}  # name -> id -> refused until (forget)
        self._flags: dict[str, Flags] = {}
        self._retry: dict[str, tuple[set[str], float]] = {}
        self._locks: dict[str, tuple[str, float]] = {}
        self._events: deque[bytes] = deque()
        self._retry_sweep_at = 1024  # sweep expired retry keys when the dict grows past this
        # Replica leases (proxy.state.lease), as the Redis store keeps them: the lease set, and
        # per backend the time each lease runs to. Reservations are keyed by their field
        # (``<id>@<lease>``); with no lease ever held, nothing is filtered on the request path.
        self._leases: dict[str, float] = {}
        self._backend_leases: dict[str, dict[str, float]] = {}

    def _field(self, reservation_id: str) -> str:
        lease = self.lease
        return lease_field(reservation_id, lease.id) if lease is not None else reservation_id

    def _counting(self, name: str, res: Iterable[Reservation], now: float) -> Iterable[Reservation]:
        """The reservations that count (proxy.state.lease.counting); all when no lease was held."""
        if not self._backend_leases and not self._leases:
            return res
        return counting(res, self._backend_leases.get(name, {}), now)

    # --- helpers (no awaits) ---
    def _state(self, name: str) -> _Entry | None:
        entry = self._states.get(name)
        if entry is not None and self._clock() >= entry.expires_at:
            del self._states[name]
            return None
        return entry

    def _live(self, name: str, now: float) -> dict[str, Reservation]:
        """The backend's reservations with expired ones purged (as the Lua script does)."""
        res = self._res.get(name)
        if res is None:
            return {}
        for rid in [rid for rid, r in res.items() if r.expires_at <= now]:
            del res[rid]
        if not res:
            del self._res[name]
            return {}
        return res

    # --- reports ---
    async def put_report(self, name: str, report: MemoryReport, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._states[name] = _Entry(report, "up", "", self._clock() + ttl_s)
        self._known.add(name)

    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        check_ttl(ttl_s)
        entry = self._state(name)
        report = entry.report if entry is not None else None
        self._states[name] = _Entry(report, "down", reason, self._clock() + ttl_s)
        self._known.add(name)

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        out: dict[str, BackendState] = {}
        for name in names:
            entry = self._state(name)
            res = self._res.get(name, {})
            out[name] = BackendState(
                name=name,
                status=entry.status if entry is not None else "unknown",
                status_reason=entry.reason if entry is not None else "",
                report=entry.report if entry is not None else None,
                reservations=live_reservations(self._counting(name, res.values(), now), now),
                flags=self._flags.get(name, Flags()),
            )
        return out

    async def known_backends(self) -> set[str]:
        return set(self._known)

    def adopt(self, state: BackendState, ttl_s: float) -> None:
        """Take another store's view of a backend (report, status, flags), not its reservations.

        The degraded-mode wrapper (proxy.state.degraded) mirrors the shared store here so that,
        the moment Redis stops answering, this replica already holds the latest known figures.
        A report older than the one held is ignored: a local scrape may be newer.
        """
        check_ttl(ttl_s)
        entry = self._state(state.name)
        held = entry.report if entry is not None else None
        report = state.report
        if held is not None and (report is None or held.reported_at > report.reported_at):
            report = held
        if state.status != "unknown" or report is not None:
            status: Status = state.status if state.status != "unknown" else "up"
            self._states[state.name] = _Entry(
                report, status, state.status_reason, self._clock() + ttl_s
            )
            self._known.add(state.name)
        self._flags[state.name] = state.flags

    # --- reservations ---
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
        check_reserve_args(tokens, now, ttl_s, headroom, grace_s)
        return self.reserve_checked(
            name,
            reservation_id,
            tokens,
            now,
            ttl_s,
            check_fit=check_fit,
            headroom=headroom,
            grace_s=grace_s,
        )

    def reserve_checked(
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
        """``reserve`` with arguments already checked (``check_reserve_args``), no coroutine:
        the degraded store's mirror of what Redis just accepted (checked before it was sent)."""
        lease = self.lease
        owner = lease.current(now) if lease is not None else ""
        field = lease_field(reservation_id, owner)
        tombs = self._tombs.get(name)
        if tombs:
            if tombs.get(field, float("-inf")) > now:
                return False  # forgotten: a reserve that arrives after its release
            for rid in [r for r, until in tombs.items() if until <= now]:
                del tombs[rid]
        live = self._live(name, now)
        if check_fit:
            entry = self._state(name)
            report = entry.report if entry is not None else None
            # The id's own earlier reservation (a reserve sent again) is being replaced.
            others = (
                [r for rid, r in live.items() if rid != field] if field in live else live.values()
            )
            counted = self._counting(name, others, now)
            pending, reserved = pending_and_reserved(report, counted, now, grace_s)
            if not reservation_fits(report, pending, tokens, headroom, reserved):
                return False
        now = float(now)
        self._res.setdefault(name, live)[field] = Reservation(
            reservation_id, tokens, now, now + ttl_s, owner
        )
        if lease is not None:
            held = self._backend_leases.setdefault(name, {})
            held[owner] = max(held.get(owner, -math.inf), lease.until)
        return True

    async def release(self, name: str, reservation_id: str) -> None:
        self.release_now(name, reservation_id)

    def release_now(self, name: str, reservation_id: str) -> None:
        """``release`` without a coroutine (the ledger's per-request path: no task needed)."""
        res = self._res.get(name)
        if res is not None:
            res.pop(self._field(reservation_id), None)
            if not res:
                del self._res[name]

    async def shrink(self, name: str, reservation_id: str, tokens: int) -> bool:
        return self.shrink_now(name, reservation_id, tokens)

    def shrink_now(self, name: str, reservation_id: str, tokens: int) -> bool:
        """``shrink`` without a coroutine (the ledger's path on the embedded store)."""
        check_tokens(tokens)
        field = self._field(reservation_id)
        held = self._res.get(name, {}).get(field)
        if held is None or held.tokens <= tokens:
            return False
        self._res[name][field] = replace(held, tokens=tokens)
        return True

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        self.forget_now(name, reservation_id, until)

    def forget_now(self, name: str, reservation_id: str, until: float) -> None:
        check_finite(until=until)
        self.release_now(name, reservation_id)
        tombs = self._tombs.setdefault(name, {})
        field = self._field(reservation_id)
        # Expired ones are swept by the next reserve on this backend.
        tombs[field] = max(float(until), tombs.get(field, float("-inf")))

    async def reservations(self, name: str, now: float) -> list[Reservation]:
        live = self._live(name, now).values()
        return list(live_reservations(self._counting(name, live, now), now))

    # --- replica leases ---
    async def renew_lease(self, now: float) -> LeaseRound:
        lease = self.lease
        if lease is None:
            raise RuntimeError("renew_lease before hold_lease")
        lease.current(now)
        if lease.registered and self._leases.get(lease.id, -math.inf) <= now:
            lease.next_epoch(now)  # lapsed (and perhaps swept) while we were away
        new = not lease.registered
        lapsed = tuple(i for i, until in self._leases.items() if until <= now)
        for i in lapsed:
            del self._leases[i]
        self._leases[lease.id] = now + lease.ttl_s
        lease.renewed(now)
        for held in self._backend_leases.values():
            if lease.id in held:
                held[lease.id] = lease.until
        dropped, tokens = self._sweep(set(lapsed), now)
        self._sweep(set(lease.retired), now)
        lease.retired.clear()
        return LeaseRound(lease.id, new, lapsed, dropped, tokens)

    def _sweep(self, lapsed: set[str], now: float) -> tuple[int, int]:
        """Remove the reservations and backend entries of lapsed leases; (live ones, tokens)."""
        dropped = tokens = 0
        if not lapsed:
            return 0, 0
        for name, res in list(self._res.items()):
            for field in [f for f, r in res.items() if r.replica in lapsed]:
                r = res.pop(field)
                if r.expires_at > now:
                    dropped, tokens = dropped + 1, tokens + r.tokens
            if not res:
                del self._res[name]
        for held in self._backend_leases.values():
            for i in lapsed & held.keys():
                del held[i]
        return dropped, tokens

    async def live_leases(self, now: float) -> dict[str, float]:
        return {i: until for i, until in self._leases.items() if until > now}

    # --- flags ---
    async def set_draining(self, name: str, draining: bool) -> None:
        self._flags[name] = replace(self._flags.get(name, Flags()), draining=bool(draining))

    async def set_cooldown(self, name: str, until: float) -> None:
        check_finite(until=until)
        self._flags[name] = replace(self._flags.get(name, Flags()), cooldown_until=float(until))

    async def set_ceiling(self, name: str, tokens: int, now: float, until: float) -> None:
        check_tokens(tokens)
        check_finite(now=now, until=until)
        entry = self._state(name)
        report = entry.report if entry is not None else None
        flags = self._flags.get(name, Flags())
        self._flags[name] = merge_ceiling(flags, report, tokens, float(now), float(until))

    # --- retry memory ---
    async def add_failed(self, retry_key: str, name: str, ttl_s: float) -> None:
        check_ttl(ttl_s)
        now = self._clock()
        names, expires_at = self._retry.get(retry_key, (set(), 0.0))
        if now >= expires_at:
            names = set()
        names.add(name)
        self._retry[retry_key] = (names, now + ttl_s)  # the TTL is refreshed on every add
        if len(self._retry) > self._retry_sweep_at:
            for key in [k for k, (_, exp) in self._retry.items() if now >= exp]:
                del self._retry[key]
            self._retry_sweep_at = max(1024, 2 * len(self._retry))

    async def failed_on(self, retry_key: str) -> set[str]:
        item = self._retry.get(retry_key)
        if item is None:
            return set()
        if self._clock() >= item[1]:
            del self._retry[retry_key]
            return set()
        return set(item[0])

    # --- coordination ---
    async def try_lock(self, lock: str, owner: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        now = self._clock()
        held = self._locks.get(lock)
        if held is not None and now < held[1] and held[0] != owner:
            return False
        self._locks[lock] = (owner, now + ttl_s)
        return True

    async def unlock(self, lock: str, owner: str) -> None:
        held = self._locks.get(lock)
        if held is not None and held[0] == owner:
            del self._locks[lock]

    # --- events ---
    async def append_event(self, event: dict[str, Any], max_len: int = 1000) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        # Stored as JSON, like the Redis list, so both stores accept and return the same things.
        self._events.appendleft(orjson.dumps(event))
        while len(self._events) > max_len:
            self._events.pop()

    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        if limit < 1:
            return []
        out: list[dict[str, Any]] = []
        for raw in self._events:
            if len(out) >= limit:
                break
            out.append(orjson.loads(raw))
        return out

    # --- lifecycle ---
    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
