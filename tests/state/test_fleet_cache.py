"""The fleet cache (proxy/state/fleet_cache.py): one read for many requests, degraded mode.

On the real in-process store; a store that goes away is that store with its reads failing
the way a timed-out Redis call does (``StoreUnavailable``), under an injected clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot, MemoryReport
from proxy.ops.maintenance import Maintenance
from proxy.state.base import BackendState, StoreUnavailable
from proxy.state.fleet_cache import FleetCache, node_from_state
from proxy.state.memory import InProcessStore
from tests.support.gateway import gateway_cfg


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Store(InProcessStore):
    """The in-process store, counting reads; ``down`` makes them fail like a dead Redis."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.down = False
        self.gate: asyncio.Event | None = None

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise StoreUnavailable("read timed out")
        return await super().read(names, now)


def config(**sections: object) -> Config:
    backends: list[dict[str, Any]] = [
        {"name": "a", "url": "http://127.0.0.1:9", "pool": "long", "capacity_tokens": 50_000},
        {"name": "b", "url": "http://127.0.0.1:9", "pool": "general"},
    ]
    return gateway_cfg(backends, **sections)


async def put(store: Store, name: str, clock: Clock, free: int = 60_000) -> None:
    report = MemoryReport(100_000, free, free, reported_at=clock.now)
    await store.put_report(name, report, 600.0)


def figures(snap: FleetSnapshot) -> dict[str, int | None]:
    return {n.name: n.report.free_tokens if n.report else None for n in snap.nodes}


async def test_snapshots_within_refresh_share_one_read() -> None:
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.5)
    await put(store, "b", clock)
    first = await cache.snapshot()
    assert await cache.snapshot() is first and store.reads == 1
    clock.now += 1.0
    assert await cache.snapshot() is not first and store.reads == 2
    assert await cache.snapshot(force=True) is not first and store.reads == 3


async def test_concurrent_snapshots_are_one_read_in_flight() -> None:
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.0)
    store.gate = asyncio.Event()
    waiting = [asyncio.create_task(cache.snapshot()) for _ in range(5)]
    await asyncio.sleep(0.01)
    store.gate.set()
    snaps = await asyncio.wait_for(asyncio.gather(*waiting), timeout=5.0)
    assert store.reads == 1
    assert all(s is snaps[0] for s in snaps)


async def seen_then_changed() -> tuple[Clock, Store, FleetCache, FleetSnapshot]:
    """A cache (refresh 20 ms, stale 0.25 s) that has read b at 60k free; b is now at 10k."""
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.02, stale_s=0.25)
    await put(store, "b", clock, free=60_000)
    first = await cache.snapshot()
    await put(store, "b", clock, free=10_000)
    return clock, store, cache, first


async def test_while_a_read_runs_the_snapshot_before_it_is_served() -> None:
    # On a busy gateway the read runs a whole turn of the loop later: only the request that
    # started it waits; the ones after it are served the snapshot before.
    clock, store, cache, first = await seen_then_changed()
    store.gate = asyncio.Event()  # the next read hangs until let go
    clock.now += 0.1
    starter = asyncio.create_task(cache.snapshot())
    await asyncio.sleep(0.01)
    assert not starter.done()  # it started the read: it waits for it
    assert await asyncio.wait_for(cache.snapshot(), timeout=1.0) is first
    assert await asyncio.wait_for(cache.snapshot(), timeout=1.0) is first
    assert store.reads == 2  # one read for all
    store.gate.set()
    fresh = await asyncio.wait_for(starter, timeout=1.0)
    assert figures(fresh) == {"a": None, "b": 10_000}
    assert await cache.snapshot() is fresh and store.reads == 2


async def test_a_quiet_gateway_sees_nothing_older_than_refresh_s() -> None:
    clock, _, cache, _ = await seen_then_changed()
    clock.now += 0.1  # past refresh_s, within stale_s, no read running
    assert figures(await cache.snapshot())["b"] == 10_000


async def test_a_quiet_gateway_does_not_see_a_released_reservation() -> None:
    # Serving the last view to the request that starts the next read (at an LLM server's
    # request rates, every request) was tried again: a reservation this replica released
    # since that view stayed in it. On a lazily allocating node the projection counts a
    # reservation it has no flight for as another replica's (``MemoryPressure._foreign``),
    # and there the store, not the projection, decides the fit.
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.02, stale_s=0.25)
    await put(store, "b", clock)
    assert await store.reserve("b", "r1", 20_000, clock.now, 60.0)
    held = await cache.snapshot()
    assert {n.name: n.overlay.reserved_tokens for n in held.nodes}["b"] == 20_000
    await store.release("b", "r1")
    clock.now += 0.05  # the next request, past refresh_s, within stale_s
    view = await cache.snapshot()
    assert {n.name: n.overlay.reserved_tokens for n in view.nodes}["b"] == 0


async def test_a_snapshot_past_stale_s_waits_for_the_read() -> None:
    clock, store, cache, _ = await seen_then_changed()
    store.gate = asyncio.Event()
    clock.now += 0.3
    waiting = asyncio.create_task(cache.snapshot())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    store.gate.set()
    assert figures(await asyncio.wait_for(waiting, timeout=1.0))["b"] == 10_000


async def test_after_invalidate_the_next_snapshot_reads_the_change() -> None:
    # A drain made by this replica is seen by the next request, not up to stale_s later.
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.5, stale_s=1.0)
    await put(store, "b", clock)
    first = await cache.snapshot()
    await store.set_draining("b", True)
    cache.invalidate()
    fresh = await cache.snapshot()
    assert fresh is not first and fresh.by_name()["b"].overlay.draining
    assert await cache.snapshot() is fresh  # once: then the refresh interval again


async def test_after_invalidate_no_snapshot_is_older_than_the_change() -> None:
    # Requests that arrive while the read started by the first one still runs wait for it
    # too: none ranks on the view from before the drain.
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.5, stale_s=1.0)
    await put(store, "b", clock)
    await cache.snapshot()
    await store.set_draining("b", True)
    cache.invalidate()
    store.gate = asyncio.Event()
    waiting = [asyncio.create_task(cache.snapshot()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiting)
    store.gate.set()
    snaps = await asyncio.wait_for(asyncio.gather(*waiting), timeout=1.0)
    assert all(s.by_name()["b"].overlay.draining for s in snaps) and store.reads == 2


async def test_a_read_left_behind_by_invalidate_does_not_overwrite_a_newer_one() -> None:
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock, refresh_s=0.0, stale_s=0.0)
    first_gate = store.gate = asyncio.Event()
    old = asyncio.create_task(cache.snapshot())
    await asyncio.sleep(0.01)
    cache.invalidate()
    clock.now += 1.0
    store.gate = asyncio.Event()
    new = asyncio.create_task(cache.snapshot())
    await asyncio.sleep(0.01)
    store.gate.set()  # the newer read ends first...
    new_snap = await asyncio.wait_for(new, timeout=1.0)
    first_gate.set()  # ...then the one started before the change
    old_snap = await asyncio.wait_for(old, timeout=1.0)
    assert store.reads == 2 and old_snap.taken_at < new_snap.taken_at
    assert cache.latest is new_snap


async def test_a_configured_capacity_caps_the_report() -> None:
    clock, store = Clock(), Store()
    cache = FleetCache(config(), store, clock=clock)
    await put(store, "a", clock, free=60_000)
    node = (await cache.snapshot()).by_name()["a"]
    assert node.role == "long"
    assert node.report is not None
    assert (node.report.capacity_tokens, node.report.free_tokens) == (50_000, 50_000)


async def test_store_down_keeps_the_last_snapshot_then_routes_by_length_only() -> None:
    clock, store = Clock(), Store()
    cache = FleetCache(
        # The last snapshot bridges an outage while both its age and its reports' are in bounds.
        config(store={"max_snapshot_age_s": 10.0}, collector={"stale_after_s": 10.0}),
        store,
        clock=clock,
        refresh_s=0.0,
    )
    changes: list[bool] = []
    cache.on_degraded_change.append(changes.append)
    await put(store, "b", clock)
    fresh = await cache.snapshot()
    assert figures(fresh)["b"] == 60_000

    store.down = True
    clock.now += 5.0
    assert await cache.snapshot() is fresh  # young enough: the last known figures
    assert cache.degraded and changes == [True] and cache.store_errors == 1

    clock.now += 10.0
    old = await cache.snapshot()
    assert figures(old) == {"a": None, "b": None}  # too old: pools only
    assert all(n.up for n in old.nodes)

    store.down = False
    clock.now += 1.0
    back = await cache.snapshot()
    assert figures(back)["b"] == 60_000
    assert not cache.degraded and changes == [True, False]


def test_a_backend_never_seen_is_up_and_unknown() -> None:
    node = node_from_state(config(), "b", None, 0.0)
    assert node.up and node.report is None and node.pool == "general"


async def test_a_drain_made_here_is_in_the_very_next_snapshot() -> None:
    # The clock stands still: without the drain's own invalidation the snapshot read before
    # it would serve for ever. (The admin e2e test shows the same with real processes, but
    # there a loaded box can let the 20 ms refresh pass between two requests.)
    clock, store = Clock(), Store()
    cfg = config()
    cache = FleetCache(cfg, store, clock=clock, refresh_s=0.02)
    maintenance = Maintenance(cfg, store, cache, owner="gw", clock=clock)
    await put(store, "a", clock)
    before = await cache.snapshot()
    assert not drained(before, "a")
    await maintenance.set_draining("a", True)
    assert drained(await cache.snapshot(), "a")
    await maintenance.set_draining("a", False)
    assert not drained(await cache.snapshot(), "a")


def drained(snap: FleetSnapshot, name: str) -> bool:
    return next(n for n in snap.nodes if n.name == name).overlay.draining
