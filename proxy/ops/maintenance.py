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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.config import Config
from proxy.core.fleet import FailureCause, FleetSnapshot, MemoryReport
from proxy.errors import RestartRefused
from proxy.ops.advice import Advice, advise
from proxy.ops.diagnosis import (
    RATE_WINDOW_S,
    FailureLog,
    FragmentationTracker,
    Restart,
    TrendSettings,
    failure_from_hook,
)
from proxy.ops.node_advice import can_take_out, update_below_since
from proxy.ops.restart import RestartRunner
from proxy.ops.restart_hooks import NoHook, RestartHook, make_hook
from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.fleet_cache import FleetCache
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.maintenance")

LOCK_NAME = "maintenance"
EVENTS_READ = 500  # how far back the event log is read for in-progress restarts and intervals
END_TYPES = ("restart_done", "restart_failed", "restart_aborted")


def partitioned_slots(cfg: Config) -> frozenset[str]:
    """llama.cpp servers with partitioned slots: their free cells lie in one slot each by
    configuration (``-np`` without ``--kv-unified``), which no restart joins."""
    return frozenset(
        b.name for b in cfg.backends if b.kind == "llamacpp" and b.kv_layout == "partitioned"
    )


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
        kind, name, restart_id = ev.get("type"), ev.get("backend"), ev.get("restart_id")
        at = ev.get("at")
        if not isinstance(name, str) or not isinstance(at, int | float):
            continue
        if kind in END_TYPES and isinstance(restart_id, str):
            ended.add(restart_id)
            if kind != "restart_done":
                last_failed.setdefault(name, float(at))
        elif kind == "restart_started":
            last_started.setdefault(name, float(at))
            if (
                isinstance(restart_id, str)
                and restart_id not in ended
                and now - at <= max_age_s
                and name not in in_progress
            ):
                in_progress[name] = dict(ev)
    return Bookkeeping(in_progress, last_started, last_failed)


class Maintenance(RestartRunner):
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
        self.settings = cfg.maintenance
        self.store = store
        self.fleet = fleet
        self.owner = owner
        self.clock = clock
        self.hook = hook if hook is not None else make_hook(self.settings.hook)
        self.urls = {b.name: b.base_url for b in cfg.backends}
        self.tracker = FragmentationTracker(
            TrendSettings(
                window_s=self.settings.trend_window_s,
                sample_interval_s=self.settings.trend_sample_interval_s,
                min_samples=self.settings.trend_min_samples,
                slope_per_hour=self.settings.trend_slope_per_hour,
                min_correlation=self.settings.trend_min_correlation,
                min_fragmentation=self.settings.trend_min_fragmentation,
            )
        )
        self.failures = FailureLog(keep_s=max(self.settings.failure_window_s, RATE_WINDOW_S) + 60.0)
        self.below_since: dict[str, float] = {}
        self.advice: Advice | None = None
        self.restarts: Counter[tuple[str, str]] = Counter()  # (backend, reason) -> count
        self.errors = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._observed: list[Restart] = []
        self._lock_held = False
        self._rounds = PeriodicTask(
            f"kvroute-maintenance-{self.owner}",
            lambda: self.tick(),
            lambda: self.settings.interval_s,
            on_error=self._round_failed,
        )
        self._books = Bookkeeping()

    # ------------------------------------------------------------------ configuration
    @property
    def acts(self) -> bool:
        """Restarts by itself: enabled and a hook that can restart."""
        return self.settings.enabled and not isinstance(self.hook, NoHook)

    @property
    def lock_ttl_s(self) -> float:
        return max(15.0, 4.0 * self.settings.interval_s)

    @property
    def max_restart_s(self) -> float:
        """A restart_started older than this with no end belongs to a gateway that died."""
        return (
            self.settings.drain_settle_s
            + self.settings.drain_timeout_s
            + self.settings.hook.timeout_s
            + self.settings.healthy_timeout_s
            + 60.0
        )

    @property
    def restarting(self) -> list[str]:
        return sorted(self._tasks)

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed backend list (discovery); a restart in progress keeps its URL."""
        self.cfg = cfg
        self.urls.update({b.name: b.base_url for b in cfg.backends})

    # ------------------------------------------------------------------ hooks from the gateway
    def on_allocation_failure(
        self,
        backend: str,
        cause: FailureCause,
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
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
        await self._unlock()
        await self.hook.close()

    def _round_failed(self, exc: Exception) -> None:
        self.errors += 1
        log.error("maintenance: round failed", exc_info=exc)

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
        self.below_since = update_below_since(
            self.below_since, snap, now, self.settings, partitioned_slots(self.cfg)
        )
        self.failures.prune(now)
        advice = self._advise(snap, now, books)
        self.advice = advice
        return advice

    def _busy(self, books: Bookkeeping) -> set[str]:
        return set(self._tasks) | set(books.in_progress)

    def _blocked_until(self, books: Bookkeeping) -> dict[str, float]:
        """Per-node minimum interval across gateways (the last start of any restart), and a
        back-off after a failed one so that a broken hook is not called every round."""
        backoff = max(self.settings.min_interval_per_node_s, 60.0)
        out: dict[str, float] = {}
        for name, at in books.last_started.items():
            out[name] = at + self.settings.min_interval_per_node_s
        for name, at in books.last_failed.items():
            out[name] = max(out.get(name, 0.0), at + backoff)
        return out

    def _advise(self, snap: FleetSnapshot, now: float, books: Bookkeeping) -> Advice:
        return advise(
            snap,
            now,
            self.settings,
            stale_after_s=self.cfg.collector.stale_after_s,
            failures=self.failures.recent(now, self.settings.failure_window_s),
            rate_failures=self.failures.recent(now, RATE_WINDOW_S),
            trends=self.tracker.trends(),
            below_since=self.below_since,
            busy=self._busy(books),
            blocked_until=self._blocked_until(books),
            split_by_config=partitioned_slots(self.cfg),
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
            if len(busy) >= self.settings.max_concurrent_restarts:
                break
            if name in busy or snap is None:
                continue
            ok, _ = can_take_out(
                snap, name, now, self.settings, self.cfg.collector.stale_after_s, busy
            )
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
        if len(busy) >= self.settings.max_concurrent_restarts:
            raise RestartRefused(
                "conflict",
                f"{len(busy)} node(s) already restarting ({', '.join(sorted(busy))}); max_concurrent_restarts is {self.settings.max_concurrent_restarts}",
            )
        snap = await self.fleet.snapshot(force=True)
        ok, why = can_take_out(
            snap, name, now, self.settings, self.cfg.collector.stale_after_s, busy
        )
        if not ok and not force:
            raise RestartRefused(
                "conflict",
                f"not safe to take {name} out now: {why} (add ?force=true to restart anyway)",
            )
        restart_id = self._spawn(name, "manual")
        return {
            "backend": name,
            "restart_id": restart_id,
            "status": "started",
            "capacity_check": why,
        }

    async def set_draining(self, name: str, draining: bool, by: str = "admin") -> None:
        if name not in self.urls:
            raise RestartRefused("unknown_backend", f"no backend named {name!r}")
        try:
            await self.store.set_draining(name, draining)
        except StoreUnavailable:
            raise RestartRefused("store_unavailable", "state store unavailable") from None
        # Requests routed after this answer must see the flag (not a snapshot from before).
        self.fleet.invalidate()
        await self._event("drain" if draining else "undrain", name, by=by)

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
