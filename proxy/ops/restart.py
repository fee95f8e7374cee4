"""One restart of one node, start to finish: drain, wait, hook, wait for a fresh allocator,
return it to service; every step recorded in the shared event log.

A mixin of ``proxy.ops.maintenance.Maintenance`` (which decides when to restart and holds the
state named below): the procedure is long enough to deserve its own module, and it reads and
writes the same state as the loop that starts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.config import MaintenanceConfig
from proxy.core.fleet import MemoryReport
from proxy.errors import RestartFailed
from proxy.ops.node_advice import RestartReason
from proxy.ops.restart_contract import HookResult, RestartHook
from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.fleet_cache import FleetCache

log = logging.getLogger("kvroute.maintenance")

POLL_S = 0.05


@dataclass(slots=True)
class RestartRun:
    """One restart under way: what its steps and its clean-up need to know."""

    name: str
    reason: RestartReason
    restart_id: str
    before: MemoryReport | None
    started: float = field(default_factory=time.monotonic)
    # Marked draining in the store: whatever ends the restart must undrain it.
    drained: bool = False


class RestartRunner:
    """Drain + restart + return of one node at a time per task (``_spawn``)."""

    settings: MaintenanceConfig
    store: StateStore
    fleet: FleetCache
    hook: RestartHook
    owner: str
    urls: dict[str, str]
    restarts: Counter[tuple[str, str]]
    _tasks: dict[str, asyncio.Task[None]]
    clock: Callable[[], float]

    def _spawn(self, name: str, reason: RestartReason) -> str:
        restart_id = uuid.uuid4().hex[:12]
        task = asyncio.get_running_loop().create_task(
            self._restart(name, reason, restart_id), name=f"kvroute-restart-{name}"
        )
        self._tasks[name] = task

        def done(_t: asyncio.Task[None]) -> None:
            if self._tasks.get(name) is task:
                del self._tasks[name]

        task.add_done_callback(done)
        return restart_id

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

    async def _restart(self, name: str, reason: RestartReason, restart_id: str) -> None:
        """One restart; whatever ends it (done, failed, shutdown, a bug) leaves the node in service."""
        snap = self.fleet.latest or await self.fleet.snapshot(force=True)
        node = snap.by_name().get(name)
        run = RestartRun(name, reason, restart_id, node.report if node is not None else None)
        await self._event(
            "restart_started", name, restart_id=restart_id, reason=reason,
            before=self._figures(run.before),
        )  # fmt: skip
        log.info("maintenance: restarting %s (%s)", name, reason)
        try:
            after = await self._drain_and_restart(run)
            await self._undrain(name)
            run.drained = False
            await self._restart_done(run, after)
        except RestartFailed as exc:
            log.warning("maintenance: restart of %s failed: %s", name, exc)
            await self._abandon(run, "restart_failed", str(exc))
        except asyncio.CancelledError:
            await self._abandon(run, "restart_aborted", "gateway shutting down")
            raise
        except Exception as exc:  # a bug must not leave the node drained forever
            log.exception("maintenance: restart of %s broke", name)
            await self._abandon(run, "restart_failed", f"{type(exc).__name__}: {exc}")

    async def _drain_and_restart(self, run: RestartRun) -> MemoryReport:
        """Drain, run the hook, wait for a fresh allocator: its first report after the hook."""
        name = run.name
        try:
            await self.store.set_draining(name, True)
        except StoreUnavailable:
            raise RestartFailed(
                "state store unavailable: could not mark the node draining"
            ) from None
        self.fleet.invalidate()
        run.drained = True
        left = await self._wait_drained(name)
        await self._event(
            "drained", name, restart_id=run.restart_id, inflight_left=left, timed_out=left > 0
        )
        hook_at = self.clock()
        result = await self._run_hook(run)
        # A deleted pod comes back under a new name (its ReplicaSet's replacement): wait
        # for that one to report, so the next restart starts only after it serves.
        old_started = run.before.started_at if run.before is not None else 0.0
        after = await self._wait_fresh(result.replaced_by or name, old_started, hook_at)
        if after is None:
            raise RestartFailed(
                f"not up with a fresh allocator within healthy_timeout_s ({self.settings.healthy_timeout_s:g}s)"
            )
        return after

    async def _run_hook(self, run: RestartRun) -> HookResult:
        """The restart hook; RestartFailed when it says it failed."""
        result = await self.hook.restart(run.name, self.urls[run.name])
        # The output (and an HTTP hook's target) goes to the log; the open event log
        # gets the summary only.
        level = logging.INFO if result.ok else logging.WARNING
        log.log(level, "maintenance: restart hook for %s: %s", run.name, result.detail)
        await self._event(
            "restart_hook", run.name, restart_id=run.restart_id, ok=result.ok,
            detail=result.public, hook=self.hook.kind,
        )  # fmt: skip
        if not result.ok:
            raise RestartFailed(f"restart hook failed: {result.public}")
        return result

    async def _restart_done(self, run: RestartRun, after: MemoryReport) -> None:
        self.restarts[(run.name, run.reason)] += 1
        await self._event(
            "restart_done", run.name, restart_id=run.restart_id, reason=run.reason,
            duration_s=round(time.monotonic() - run.started, 3),
            before=self._figures(run.before), after=self._figures(after),
        )  # fmt: skip
        log.info("maintenance: %s restarted and back in service", run.name)

    async def _abandon(self, run: RestartRun, kind: str, error: str) -> None:
        """A restart that did not finish: the node back in service, the event recorded."""
        if run.drained:
            await self._undrain(run.name)
        await self._event(kind, run.name, restart_id=run.restart_id, reason=run.reason, error=error)

    async def _undrain(self, name: str) -> None:
        for _ in range(3):
            try:
                await self.store.set_draining(name, False)
                self.fleet.invalidate()
                return
            except StoreUnavailable:
                await asyncio.sleep(0.2)
        log.error("maintenance: could not undrain %s (store unavailable): undrain it by hand", name)

    async def _wait_drained(self, name: str) -> int:
        """Wait until no reservation is left on ``name`` (twice in a row); returns how many are left."""
        # Routers may rank on a snapshot taken just before the drain mark: let that pass first.
        await asyncio.sleep(self.settings.drain_settle_s)
        deadline = time.monotonic() + self.settings.drain_timeout_s
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
        deadline = time.monotonic() + self.settings.healthy_timeout_s
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
                and r.largest_block_ratio >= self.settings.fresh_ratio
            ):
                return r
            await asyncio.sleep(POLL_S * 2)
        return None
