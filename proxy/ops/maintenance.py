"""Fleet operations: observe fragmentation, advise, and drain + restart fragmented nodes.

One ``Maintenance`` per gateway. Every ``maintenance.interval_s`` it reads the fleet, feeds
the fragmentation-vs-uptime tracker, and computes the advice (``proxy.ops.advice``). With
``maintenance.enabled`` and a restart hook, it also acts on the advice: for each node advised
as ready it marks the node draining (the policy sends it nothing new), waits for the
requests in flight on it to finish (``drain_timeout_s``), calls the hook, waits until the
node is up and reports a fresh allocator (a newer start time, largest block / free at least
``fresh_ratio``; ``healthy_timeout_s``), and returns it to service.

Gateway replicas sharing Redis act one at a time: only the holder of the ``maintenance``
lock (with expiry, renewed every round while it has work) starts restarts. The shared event
log is the second guard: restarts another replica started and has not finished count
against ``max_concurrent_restarts`` too, so a lapsed lock cannot double the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot, MemoryReport
from proxy.errors import RestartRefused
from proxy.ops.advice import Advice, RestartReason, advise, can_take_out, update_below_since
from proxy.ops.diagnosis import (
    RATE_WINDOW_S,
    FailureLog,
    FragmentationTracker,
    Restart,
    TrendSettings,
    failure_from_hook,
)
from proxy.ops.restart_hooks import NoHook, RestartHook, make_hook
from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.fleet_cache import FleetCache

log = logging.getLogger("kvroute.maintenance")

LOCK_NAME = "maintenance"
EVENTS_READ = 500  # how far back the event log is read for in-progress restarts and intervals
END_TYPES = ("restart_done", "restart_failed", "restart_aborted")
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Bookkeeping:
    """What the shared event log says about restarts (any gateway's)."""

    # backend -> its restart_started event
    in_progress: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    last_started: Mapping[str, float] = field(default_factory=dict)
    last_failed: Mapping[str, float] = field(default_factory=dict)


def bookkeeping(events: Sequence[Mapping[str, Any]], now: float, max_age_s: float) -> Bookkeeping:
    """Read newest-first events: restarts started and not ended (younger than ``max_age_s``:
    older ones belong to a gateway that died mid-restart), and each node's latest start/failure."""
    ended: set[str] = set()
    in_progress: dict[str, dict[str, Any]] = {}
    last_started: dict[str, float] = {}
    last_failed: dict[str, float] = {}
    for ev in events:
        kind, name, rid = ev.get("type"), ev.get("backend"), ev.get("restart_id")
        at = ev.get("at")
        if not isinstance(name, str) or not isinstance(at, int | float):
            continue
        if kind in END_TYPES and isinstance(rid, str):
            ended.add(rid)
            if kind != "restart_done":
                last_failed.setdefault(name, float(at))
        elif kind == "restart_started":
            last_started.setdefault(name, float(at))
            if (
                isinstance(rid, str)
                and rid not in ended
                and now - at <= max_age_s
                and name not in in_progress
            ):
                in_progress[name] = dict(ev)
    return Bookkeeping(in_progress, last_started, last_failed)


class _Failed(Exception):
    pass


class Maintenance:
    """Diagnosis, advice and the drain + restart loop of one gateway."""

    def __init__(
        self,
        cfg: Config,
        store: StateStore,
        fleet: FleetCache,
        owner: str,
        hook: RestartHook | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.m = cfg.maintenance
        self.store = store
        self.fleet = fleet
        self.owner = owner
        self.clock = clock
        self.hook = hook if hook is not None else make_hook(self.m.hook)
        self.urls = {b.name: b.base_url for b in cfg.backends}
        self.tracker = FragmentationTracker(
            TrendSettings(
                window_s=self.m.trend_window_s,
                sample_interval_s=self.m.trend_sample_interval_s,
                min_samples=self.m.trend_min_samples,
                slope_per_hour=self.m.trend_slope_per_hour,
                min_correlation=self.m.trend_min_correlation,
                min_fragmentation=self.m.trend_min_fragmentation,
            )
        )
        self.failures = FailureLog(keep_s=max(self.m.failure_window_s, RATE_WINDOW_S) + 60.0)
        self.below_since: dict[str, float] = {}
        self.advice: Advice | None = None
        self.restarts: Counter[tuple[str, str]] = Counter()  # (backend, reason) -> count
        self.errors = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._observed: list[Restart] = []
        self._lock_held = False
        self._loop_task: asyncio.Task[None] | None = None
        self._books = Bookkeeping()

    # ------------------------------------------------------------------ configuration
    @property
    def acts(self) -> bool:
        """Restarts by itself: enabled and a hook that can restart."""
        return self.m.enabled and not isinstance(self.hook, NoHook)

    @property
    def lock_ttl_s(self) -> float:
        return max(15.0, 4.0 * self.m.interval_s)

    @property
    def max_restart_s(self) -> float:
        """A restart_started older than this with no end belongs to a gateway that died."""
        return (
            self.m.drain_settle_s
            + self.m.drain_timeout_s
            + self.m.hook.timeout_s
            + self.m.healthy_timeout_s
            + 60.0
        )

    @property
    def restarting(self) -> list[str]:
        return sorted(self._tasks)

    # ------------------------------------------------------------------ hooks from the gateway
    def on_allocation_failure(
        self,
        backend: str,
        cause: str,
        demand: int,
        fleet_free_fraction: float,
        room_on: tuple[str, ...] | None = None,
    ) -> None:
        self.failures.add(
            failure_from_hook(
                self.fleet.latest,
                backend,
                cause,
                demand,
                fleet_free_fraction,
                self.clock(),
                room_on=room_on,
            )
        )

    def on_report(self, name: str, report: MemoryReport) -> None:
        restart = self.tracker.observe(name, report)
        if restart is not None:
            self._observed.append(restart)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kvroute-maintenance-{self.owner}"
            )

    async def stop(self) -> None:
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        await self._unlock()
        await self.hook.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive anything one round does
                self.errors += 1
                log.exception("maintenance: round failed")
            await asyncio.sleep(self.m.interval_s)

    # ------------------------------------------------------------------ one round
    async def _read_books(self, now: float) -> Bookkeeping:
        try:
            events = await self.store.events(EVENTS_READ)
        except StoreUnavailable:
            return self._books  # the last known; acting is skipped anyway without the lock
        self._books = bookkeeping(events, now, self.max_restart_s)
        return self._books

    async def evaluate(self) -> Advice:
        """Read the fleet, update the trend and thresholds, compute the advice (acts on nothing)."""
        snap = await self.fleet.snapshot(force=True)
        now = self.clock()
        for n in snap.nodes:
            if n.report is not None:
                self.on_report(n.name, n.report)
        books = await self._read_books(now)
        await self._count_observed(books)
        self.below_since = update_below_since(self.below_since, snap, now, self.m)
        self.failures.prune(now)
        advice = self._advise(snap, now, books)
        self.advice = advice
        return advice

    def _busy(self, books: Bookkeeping) -> set[str]:
        return set(self._tasks) | set(books.in_progress)

    def _blocked_until(self, books: Bookkeeping) -> dict[str, float]:
        """Per-node minimum interval across gateways (the last start of any restart), and a
        back-off after a failed one so that a broken hook is not called every round."""
        backoff = max(self.m.min_interval_per_node_s, 60.0)
        out: dict[str, float] = {}
        for name, at in books.last_started.items():
            out[name] = at + self.m.min_interval_per_node_s
        for name, at in books.last_failed.items():
            out[name] = max(out.get(name, 0.0), at + backoff)
        return out

    def _advise(self, snap: FleetSnapshot, now: float, books: Bookkeeping) -> Advice:
        return advise(
            snap,
            now,
            self.m,
            stale_after_s=self.cfg.collector.stale_after_s,
            failures=self.failures.recent(now, self.m.failure_window_s),
            rate_failures=self.failures.recent(now, RATE_WINDOW_S),
            trends=self.tracker.trends(),
            below_since=self.below_since,
            busy=self._busy(books),
            blocked_until=self._blocked_until(books),
        )

    async def tick(self) -> Advice:
        advice = await self.evaluate()
        work = list(advice.restart) if self.acts else []
        if not work and not self._tasks:
            await self._unlock()
            return advice
        if not await self._lock():
            return advice
        now = self.clock()
        busy = self._busy(self._books)
        snap = self.fleet.latest
        for name in work:
            if len(busy) >= self.m.max_concurrent_restarts:
                break
            if name in busy or snap is None:
                continue
            ok, _ = can_take_out(snap, name, now, self.m, self.cfg.collector.stale_after_s, busy)
            if not ok:
                continue
            node = advice.node(name)
            self._spawn(name, node.reason if node is not None else "fragmentation")
            busy.add(name)
        return advice

    # ------------------------------------------------------------------ the lock
    async def _lock(self) -> bool:
        try:
            got = await self.store.try_lock(LOCK_NAME, self.owner, self.lock_ttl_s)
        except StoreUnavailable:
            got = False
        if got != self._lock_held:
            log.info(
                "maintenance: %s %s the maintenance lock",
                self.owner,
                "took" if got else "does not hold",
            )
        self._lock_held = got
        return got

    async def _unlock(self) -> None:
        if not self._lock_held:
            return
        self._lock_held = False
        with contextlib.suppress(StoreUnavailable):
            await self.store.unlock(LOCK_NAME, self.owner)

    # ------------------------------------------------------------------ manual actions (admin API)
    async def request_restart(self, name: str, force: bool = False) -> dict[str, Any]:
        """Start a restart of ``name`` now (by hand). Raises RestartRefused when it cannot start."""
        if name not in self.urls:
            raise RestartRefused("unknown_backend", f"no backend named {name!r}")
        if isinstance(self.hook, NoHook):
            raise RestartRefused(
                "conflict",
                "no restart hook configured (maintenance.hook.type is 'none'): drain it and restart it yourself",
            )
        if name in self._tasks:
            raise RestartRefused("conflict", f"{name} is already being restarted")
        now = self.clock()
        books = await self._read_books(now)
        if name in books.in_progress:
            raise RestartRefused(
                "conflict",
                f"{name} is already being restarted by {books.in_progress[name].get('by')}",
            )
        if not await self._lock():
            raise RestartRefused(
                "conflict",
                "another gateway holds the maintenance lock (a restart is under way there); try again later",
            )
        busy = self._busy(books)
        if len(busy) >= self.m.max_concurrent_restarts:
            raise RestartRefused(
                "conflict",
                f"{len(busy)} node(s) already restarting ({', '.join(sorted(busy))}); max_concurrent_restarts is {self.m.max_concurrent_restarts}",
            )
        snap = await self.fleet.snapshot(force=True)
        ok, why = can_take_out(snap, name, now, self.m, self.cfg.collector.stale_after_s, busy)
        if not ok and not force:
            raise RestartRefused(
                "conflict",
                f"not safe to take {name} out now: {why} (add ?force=true to restart anyway)",
            )
        rid = self._spawn(name, "manual")
        return {"backend": name, "restart_id": rid, "status": "started", "capacity_check": why}

    async def set_draining(self, name: str, draining: bool, by: str = "admin") -> None:
        if name not in self.urls:
            raise RestartRefused("unknown_backend", f"no backend named {name!r}")
        try:
            await self.store.set_draining(name, draining)
        except StoreUnavailable:
            raise RestartRefused("store_unavailable", "state store unavailable") from None
        await self._event("drain" if draining else "undrain", name, by=by)

    # ------------------------------------------------------------------ one restart
    def _spawn(self, name: str, reason: RestartReason) -> str:
        rid = uuid.uuid4().hex[:12]
        task = asyncio.get_running_loop().create_task(
            self._restart(name, reason, rid), name=f"kvroute-restart-{name}"
        )
        self._tasks[name] = task

        def done(_t: asyncio.Task[None]) -> None:
            if self._tasks.get(name) is task:
                del self._tasks[name]

        task.add_done_callback(done)
        return rid

    async def _event(self, kind: str, backend: str, **fields: Any) -> None:
        ev = {
            "id": uuid.uuid4().hex[:12],
            "type": kind,
            "backend": backend,
            "at": self.clock(),
            "by": self.owner,
            **fields,
        }
        try:
            await self.store.append_event(ev)
        except StoreUnavailable:
            log.warning(
                "maintenance: could not record event %s for %s (store unavailable)", kind, backend
            )

    def _figures(self, report: MemoryReport | None) -> dict[str, Any]:
        if report is None:
            return {}
        now = self.clock()
        return {
            "largest_contiguous_free_block_ratio": round(report.largest_block_ratio, 4),
            "free_tokens": report.free_tokens,
            "largest_free_block_tokens": report.largest_free_block_tokens,
            "uptime_s": round(report.uptime(now), 3),
        }

    async def _restart(self, name: str, reason: RestartReason, rid: str) -> None:
        snap = self.fleet.latest or await self.fleet.snapshot(force=True)
        node = snap.by_name().get(name)
        before = node.report if node is not None else None
        old_started = before.started_at if before is not None else 0.0
        t0 = time.monotonic()
        drained = False
        await self._event(
            "restart_started", name, restart_id=rid, reason=reason, before=self._figures(before)
        )
        log.info("maintenance: restarting %s (%s)", name, reason)
        try:
            try:
                await self.store.set_draining(name, True)
            except StoreUnavailable:
                raise _Failed("state store unavailable: could not mark the node draining") from None
            drained = True
            left = await self._wait_drained(name)
            await self._event(
                "drained", name, restart_id=rid, inflight_left=left, timed_out=left > 0
            )
            hook_at = self.clock()
            result = await self.hook.restart(name, self.urls[name])
            await self._event(
                "restart_hook",
                name,
                restart_id=rid,
                ok=result.ok,
                detail=result.detail,
                hook=self.hook.kind,
            )
            if not result.ok:
                raise _Failed(f"restart hook failed: {result.detail}")
            after = await self._wait_fresh(name, old_started, hook_at)
            if after is None:
                raise _Failed(
                    f"not up with a fresh allocator within healthy_timeout_s ({self.m.healthy_timeout_s:g}s)"
                )
            await self._undrain(name)
            drained = False
            self.restarts[(name, reason)] += 1
            await self._event(
                "restart_done",
                name,
                restart_id=rid,
                reason=reason,
                duration_s=round(time.monotonic() - t0, 3),
                before=self._figures(before),
                after=self._figures(after),
            )
            log.info("maintenance: %s restarted and back in service", name)
        except _Failed as exc:
            log.warning("maintenance: restart of %s failed: %s", name, exc)
            if drained:
                await self._undrain(name)
            await self._event("restart_failed", name, restart_id=rid, reason=reason, error=str(exc))
        except asyncio.CancelledError:
            if drained:
                await self._undrain(name)
            await self._event(
                "restart_aborted",
                name,
                restart_id=rid,
                reason=reason,
                error="gateway shutting down",
            )
            raise
        except Exception as exc:  # a bug must not leave the node drained forever
            log.exception("maintenance: restart of %s broke", name)
            if drained:
                await self._undrain(name)
            await self._event(
                "restart_failed",
                name,
                restart_id=rid,
                reason=reason,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def _undrain(self, name: str) -> None:
        for _ in range(3):
            try:
                await self.store.set_draining(name, False)
                return
            except StoreUnavailable:
                await asyncio.sleep(0.2)
        log.error("maintenance: could not undrain %s (store unavailable): undrain it by hand", name)

    async def _wait_drained(self, name: str) -> int:
        """Wait until no reservation is left on ``name`` (twice in a row); returns how many are left."""
        # Routers may rank on a snapshot taken just before the drain mark: let that pass first.
        await asyncio.sleep(self.m.drain_settle_s)
        deadline = time.monotonic() + self.m.drain_timeout_s
        empty_reads = 0
        left = -1
        while True:
            try:
                left = len(await self.store.reservations(name, self.clock()))
            except StoreUnavailable:
                left = -1 if left < 0 else left
            empty_reads = empty_reads + 1 if left == 0 else 0
            if empty_reads >= 2:
                return 0
            if time.monotonic() >= deadline:
                return max(left, 0)
            await asyncio.sleep(POLL_S)

    async def _wait_fresh(
        self, name: str, old_started: float, hook_at: float
    ) -> MemoryReport | None:
        """The node is up and reports, after the hook, a newer start and a (nearly) whole cache."""
        deadline = time.monotonic() + self.m.healthy_timeout_s
        while time.monotonic() < deadline:
            snap = await self.fleet.snapshot(force=True)
            node = snap.by_name().get(name)
            r = node.report if node is not None else None
            if (
                node is not None
                and node.up
                and r is not None
                and r.reported_at > hook_at
                and (old_started <= 0 or r.started_at > old_started)
                and r.largest_block_ratio >= self.m.fresh_ratio
            ):
                return r
            await asyncio.sleep(POLL_S * 2)
        return None

    # ------------------------------------------------------------------ restarts seen, not made
    async def _count_observed(self, books: Bookkeeping) -> None:
        """A node came back with a newer start time: count it, unless a gateway restarted it."""
        observed, self._observed = self._observed, []
        for r in observed:
            if r.backend in self._tasks or r.backend in books.in_progress:
                continue
            started = books.last_started.get(r.backend)
            if started is not None and started >= r.previous_started_at:
                continue  # a kvroute restart (this gateway's or another's) since the previous start
            self.restarts[(r.backend, "observed")] += 1
            await self._event(
                "restart_observed",
                r.backend,
                previous_started_at=r.previous_started_at,
                started_at=r.started_at,
            )
