"""The router's view of the fleet: one store read shared by many requests, degraded mode.

Reading the store once per request would put a Redis round trip on every request; the
snapshot is instead refreshed at most every ``refresh_s`` by one reader (single flight).
Ranking on a snapshot a few ms old is safe because the reservation that follows is atomic
in the store and checks the live figures, and this replica's own reservations are laid
over it as they are made (``proxy.gateway.local_view``).

The read is a task, and waiting for it cost a request a whole turn of the event loop: on a
busy gateway (220 KB prompts at 150 connections) the task runs only after every callback
already queued, and every request that came in meanwhile waited for it too: 47% of
requests, ~145 ms each. Now only the request that starts a read waits for it: while it
runs, the snapshot before it (younger than ``stale_s``) is served. A quiet gateway, whose
reads end within the turn, sees what it saw before: nothing older than ``refresh_s``.
Past ``stale_s`` (a loop stalled that long), after ``invalidate`` (this replica changed a
backend's flags or the backend list), while degraded, or when forced, every request
waits for the read.

With degraded mode (proxy.state.degraded, the default for Redis) the store itself answers
from this replica's local scrapes and reservations while Redis is away, and ``degraded``
mirrors it. A store that raises instead (``store.degraded_mode: snapshot``) is bridged
with the last snapshot, but only while its reports are younger than
``collector.stale_after_s`` (older, every node would count as stale and requests that fit
would get 503), and at most ``max_snapshot_age_s``; then by length only (pools, no memory
figures). Reads go through the request path's circuit breaker (``self.breaker``, shared
with the gateway), so a paused store costs one deadline per open interval.

Times come from the store's clock (``StateStore.now``) unless a clock is passed in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.core.pressure import PressureConfig, PressureTracker
from proxy.state.base import BackendState, StateStore, StoreUnavailable
from proxy.state.breaker import CircuitBreaker

log = logging.getLogger("kvroute.fleet")

#: How old a snapshot may be served while the next one is read: longer than a busy loop's
#: turn (~150 ms measured at 150 connections of 220 KB prompts), far shorter than a scrape.
STALE_S = 0.25


def node_from_state(cfg: Config, name: str, st: BackendState | None, now: float) -> NodeView:
    b = cfg.backend(name)
    role = cfg.pool_role(b.pool)
    if st is None:
        return NodeView(name=name, pool=b.pool, role=role, up=True, report=None)
    report = st.report
    if (
        report is not None
        and b.capacity_tokens is not None
        and report.capacity_tokens != b.capacity_tokens
    ):
        cap = b.capacity_tokens
        # replace(), not a new report: queueing, engines, preemptions... must survive.
        report = dataclasses.replace(
            report,
            capacity_tokens=cap,
            free_tokens=min(report.free_tokens, cap),
            largest_free_block_tokens=min(report.largest_free_block_tokens, cap),
        )
    return NodeView(
        name=name,
        pool=b.pool,
        role=role,
        up=st.status != "down",
        report=report,
        overlay=st.overlay(now, cfg.store.report_grace_s),
    )


class FleetCache:
    """Holds the latest fleet snapshot; refreshes it from the store on demand."""

    def __init__(
        self,
        cfg: Config,
        store: StateStore,
        clock: Callable[[], float] | None = None,
        refresh_s: float = 0.02,
        stale_s: float = STALE_S,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.clock = clock if clock is not None else store.now
        self.refresh_s = refresh_s
        # At most this old while the next read runs (no serving stale below refresh_s).
        self.stale_s = stale_s
        # Set by ``invalidate`` until a read started after it has ended.
        self._invalid = False
        self._generation = 0
        self.names = [b.name for b in cfg.backends]
        self._snap: FleetSnapshot | None = None
        self._last_ok: float = 0.0
        self._inflight: asyncio.Task[FleetSnapshot] | None = None
        self.degraded = False
        self.store_errors = 0
        self.on_degraded_change: list[Callable[[bool], None]] = []
        # Queue / preemption / slot signals with hysteresis (proxy.core.pressure).
        self.pressure = PressureTracker(PressureConfig(cfg.collector.pressure_hold_s))
        own = getattr(store, "breaker", None)
        # A degraded-mode store brings the breaker it runs around Redis: one circuit, not two.
        self.breaker = (
            own
            if isinstance(own, CircuitBreaker)
            else CircuitBreaker(cfg.store.breaker_failures, cfg.store.breaker_open_s)
        )

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed backend list (discovery); the next snapshot reads the new names."""
        self.cfg = cfg
        self.names = [b.name for b in cfg.backends]
        # No request may rank on a view of the old list (a removed backend in it).
        self.invalidate()

    @property
    def latest(self) -> FleetSnapshot | None:
        return self._snap

    def _set_degraded(self, value: bool) -> None:
        if value != self.degraded:
            self.degraded = value
            log.warning(
                "state store %s",
                "unreachable: routing degraded" if value else "reachable again",
            )
            for cb in self.on_degraded_change:
                cb(value)

    def length_only(self, now: float) -> FleetSnapshot:
        """No memory figures at all: every node unknown, the policy falls back to pools."""
        return FleetSnapshot(
            tuple(node_from_state(self.cfg, n, None, now) for n in self.names), taken_at=now
        )

    async def _read(self) -> FleetSnapshot:
        now = self.clock()
        generation = self._generation
        try:
            states = await self.breaker.call(lambda: self.store.read(self.names, now), "read")
        except StoreUnavailable:
            self.store_errors += 1
            self._set_degraded(True)
            bridge = min(self.cfg.store.max_snapshot_age_s, self.cfg.collector.stale_after_s)
            if self._snap is not None and now - self._last_ok <= bridge:
                return self._snap
            return self.length_only(now)
        self._set_degraded(self.store.degraded)
        snap = FleetSnapshot(
            tuple(
                self._with_pressure(node_from_state(self.cfg, n, states.get(n), now), now)
                for n in self.names
            ),
            taken_at=now,
        )
        if self._snap is None or now >= self._snap.taken_at:
            # A read left behind by ``invalidate`` may end after a newer one.
            self._snap = snap
            self._last_ok = now
        if generation == self._generation:
            self._invalid = False
        return snap

    def _with_pressure(self, node: NodeView, now: float) -> NodeView:
        """A queueing node that shows a queue, preemptions, full slots or sleep is full for now."""
        if node.report is None or not node.report.queueing:
            return node
        self.pressure.observe(node.name, node.report, now)
        reason = self.pressure.reason(node.name, now)
        if not reason:
            return node
        return dataclasses.replace(node, overlay=dataclasses.replace(node.overlay, pressure=reason))

    async def snapshot(self, force: bool = False) -> FleetSnapshot:
        """The fleet as of at most ``refresh_s`` ago, or up to ``stale_s`` while a read runs.

        The request that finds the snapshot too old starts the read and waits for it; the
        ones that come while it runs do not."""
        snap = self._snap
        if not force and snap is not None and not self.degraded and not self._invalid:
            age = self.clock() - snap.taken_at
            if age < self.refresh_s:
                return snap
            reading = self._inflight
            if age < self.stale_s and reading is not None and not reading.done():
                # A read is on its way (the loop has not run it yet): served now, the
                # requests after this one get what it brings.
                return snap
        return await asyncio.shield(self._read_in_flight())

    def invalidate(self) -> None:
        """Snapshots wait for a read again: this replica has just changed the store.

        Until a read started after this call has ended, every snapshot waits for it. A read
        already running may have read the store before the change: it is left to those
        awaiting it, and the next snapshot starts its own."""
        self._invalid = True
        self._generation += 1
        self._inflight = None

    def _read_in_flight(self) -> asyncio.Task[FleetSnapshot]:
        """The read running now, or a new one (single flight)."""
        task = self._inflight
        if task is None or task.done():
            # The read runs as its own task, owned by no caller: any caller may be cancelled
            # (a client gone) without cancelling the read everyone else is waiting on.
            task = asyncio.get_running_loop().create_task(self._read(), name="kvroute-fleet-read")
            self._inflight = task
            task.add_done_callback(self._read_done)
        return task

    def _read_done(self, task: asyncio.Task[FleetSnapshot]) -> None:
        if self._inflight is task:
            self._inflight = None
        if not task.cancelled():
            task.exception()  # retrieved: a failed read is re-raised to its waiters only
