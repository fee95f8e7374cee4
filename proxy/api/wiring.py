"""The gateway's components, in start order (stopped in the reverse, ``proxy.api.lifecycle``).

Each component is a start and a stop over one ``Wiring``: what earlier components built,
read by later ones. Adding a part of the process is one line in ``GATEWAY_COMPONENTS``
(``Component("name", start, stop)``), placed after what it reads and before what reads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI

from proxy.api.drain import Drain
from proxy.api.heap import freeze_startup_heap
from proxy.api.kind_check import KindCheck
from proxy.api.lifecycle import Component
from proxy.api.model_listing import kind_errors, lookup_from
from proxy.api.reconfigure import follow, policy_for
from proxy.api.reload import ConfigHolder, Reloader, ReloadMetrics
from proxy.backends.collector import Collector
from proxy.backends.collector_metrics import CollectorMetrics
from proxy.backends.discovery import Discovery
from proxy.backends.discovery_source import make_discovery
from proxy.backends.kv_events import KvEventFeeds
from proxy.backends.kv_events_metrics import KvEventsCollector
from proxy.config import BackendConfig, Config
from proxy.gateway.metrics import GatewayMetrics
from proxy.gateway.sizing import load_sizer
from proxy.gateway.walk import Gateway
from proxy.ops.maintenance import Maintenance
from proxy.ops.metrics import OpsCollector
from proxy.state import InProcessStore, open_store, with_local_fallback
from proxy.state.base import StateStore
from proxy.state.fleet_cache import FleetCache
from proxy.state.lease_task import LeaseKeeper, LeaseMetrics
from proxy.state.prefix_share import PrefixShare
from proxy.upstream.client import Upstream

log = logging.getLogger("kvroute.app")


@dataclass
class Runtime:
    """Everything the components start, reachable from handlers through app.state.rt."""

    cfg: Config
    store: StateStore
    fleet: FleetCache
    gateway: Gateway
    collector: Collector | None
    upstream: Upstream
    metrics: GatewayMetrics
    owner_id: str
    started_at: float = field(default_factory=time.time)
    models_cache: tuple[float, bytes] | None = None
    reloader: Reloader | None = None


class Wiring:
    """What startup builds, part by part; an attribute exists once its component started.

    The arguments come from ``create_app``; the rest are set by the components below.
    """

    store: StateStore
    metrics: GatewayMetrics
    fleet: FleetCache
    upstream: Upstream
    gateway: Gateway
    share: PrefixShare | None
    lease: LeaseKeeper | None
    kv_events: KvEventFeeds
    collector: Collector | None
    runtime: Runtime
    ops: Maintenance
    discovery: Discovery | None
    reloader: Reloader

    def __init__(
        self,
        app: FastAPI,
        holder: ConfigHolder,
        given_store: StateStore | None = None,
        run_collector: bool = True,
        freeze_heap: bool = False,
        reload_on_hup: bool = True,
        drain: Drain | None = None,
    ) -> None:
        self.app = app
        self.holder = holder
        self.cfg = holder.current
        self.given_store = given_store
        self.run_collector = run_collector
        self.freeze_heap = freeze_heap
        # False: SIGHUP is left to the server, which stops (proxy.api.hangup).
        self.reload_on_hup = reload_on_hup
        # Shutdown state (proxy.api.drain): the streams a drain's end interrupts.
        self.drain = drain
        self.sighup = contextlib.ExitStack()


def follow_backends(holder: ConfigHolder) -> Callable[[list[BackendConfig]], None]:
    """Hand a discovered backend list to every part that keeps one: through the config
    holder, the one road every config change takes (reloads too, proxy.api.reload)."""

    def apply(backends: list[BackendConfig]) -> None:
        holder.swap(holder.current.model_copy(update={"backends": backends}))

    return apply


def keep_discovered(discovery: Discovery | None) -> Callable[[Config], Config]:
    """A reloaded file's static ``backends`` plus what discovery found, as discovery merges them."""

    def adjust(new: Config) -> Config:
        if discovery is None:
            return new
        static = {b.name for b in discovery.static}
        found = [b for b in discovery.backends if b.name not in static]
        discovery.static = list(new.backends)
        discovery.publish_quietly(found)
        return new.model_copy(update={"backends": list(discovery.backends)})

    return adjust


async def load_tokenizers(w: Wiring) -> None:
    # Now, off the loop: lazily, the first request would stall the loop ~0.4 s.
    await load_sizer(w.cfg)


async def open_the_store(w: Wiring) -> None:
    # A store opened here gets degraded mode: local scrapes and reservations while Redis is away.
    st = w.given_store or with_local_fallback(open_store(w.cfg.store), w.cfg)
    w.store = st
    # Times shared between replicas run on the store's clock: measure the offset first.
    with contextlib.suppress(Exception):
        await st.sync_clock()


async def close_the_store(w: Wiring) -> None:
    # A store passed in belongs to its caller (the tests).
    if w.given_store is None:
        await w.store.close()


async def start_fleet_view(w: Wiring) -> None:
    w.metrics = metrics = GatewayMetrics()
    w.fleet = fleet = FleetCache(w.cfg, w.store)
    metrics.attach_fleet(lambda: fleet.latest, w.store.now)
    fleet.on_degraded_change.append(lambda d: metrics.store_degraded.set(1 if d else 0))


async def start_upstream(w: Wiring) -> None:
    w.upstream = Upstream(w.cfg.upstream)
    await w.upstream.start()


async def close_upstream(w: Wiring) -> None:
    await w.upstream.close()


async def start_gateway(w: Wiring) -> None:
    st = w.store
    w.gateway = Gateway(w.cfg, st, w.fleet, policy_for(w.cfg), w.upstream, w.metrics, st.now)
    w.gateway.kind_errors = kind_errors  # each backend kind's adapter reads its errors
    await w.gateway.start()  # active health checks (proxy.upstream.health)
    if w.drain is not None:
        w.drain.streams = w.gateway.live_streams


async def close_gateway(w: Wiring) -> None:
    # Stops health checks, releases every reservation still held.
    await w.gateway.close()


async def start_lease(w: Wiring) -> None:
    # A replica that dies takes its reservations with it (proxy.state.lease): a shared store only.
    st, cfg = w.store, w.cfg.store
    shared = not isinstance(st, InProcessStore)
    w.lease = keeper = (
        LeaseKeeper(st, cfg.lease_ttl_s, w.gateway.ledger.mark_unsure, w.gateway.ledger.reassert)
        if shared and cfg.uses_redis and cfg.leases
        else None
    )
    if keeper is not None:
        w.metrics.registry.register(LeaseMetrics(keeper))
        await keeper.start()


async def stop_lease(w: Wiring) -> None:
    if w.lease is not None:
        await w.lease.stop()


async def start_prefix_share(w: Wiring) -> None:
    # Replicas share prefix placements through Redis when configured (read at start only).
    gateway = w.gateway
    w.share = share = PrefixShare.from_config(w.cfg, lambda: gateway.affinity, w.store.now)
    if share is not None:
        gateway.affinity.share = share
        share.start()
    w.app.state.prefix_share = share


async def close_prefix_share(w: Wiring) -> None:
    if w.share is not None:
        await w.share.close()


async def start_kv_events(w: Wiring) -> None:
    # KV-cache events, where backends publish them (docs/kv-events.md).
    holder, fleet, gateway = w.holder, w.fleet, w.gateway
    w.kv_events = feeds = KvEventFeeds(lambda: holder.current, lambda: fleet.latest, w.store.now)
    if w.cfg.routing.prefix.events.enabled:
        gateway.affinity.exact = feeds
        w.metrics.registry.register(KvEventsCollector(feeds))
        feeds.start()
    w.app.state.kv_events = feeds if gateway.affinity.exact is not None else None


async def stop_kv_events(w: Wiring) -> None:
    await w.kv_events.stop()


async def start_collector(w: Wiring) -> None:
    owner = owner_id(w.app)
    w.collector = collector = Collector(w.cfg, w.store, owner) if w.run_collector else None
    if collector is not None:
        gateway, app = w.gateway, w.app
        gateway.models_info = lookup_from(collector.models)
        collector.on_report.append(lambda name, report: gateway.admission.notify())
        collector.on_report.append(KindCheck(lambda: app.state.rt.cfg).on_report)
        w.metrics.registry.register(CollectorMetrics(collector.status))
        collector.start()
    w.runtime = Runtime(w.cfg, w.store, w.fleet, w.gateway, collector, w.upstream, w.metrics, owner)
    w.app.state.rt = w.runtime


async def stop_collector(w: Wiring) -> None:
    if w.collector is not None:
        await w.collector.stop()


async def start_maintenance(w: Wiring) -> None:
    # Diagnosis, advice, drain + restart (proxy.ops.maintenance).
    w.ops = ops = Maintenance(w.cfg, w.store, w.fleet, owner_id(w.app), clock=w.store.now)
    w.gateway.on_allocation_failure.append(ops.on_allocation_failure)
    if w.collector is not None:
        w.collector.on_report.append(ops.on_report)
    w.metrics.registry.register(OpsCollector(ops, w.store.now))
    w.app.state.ops = ops
    runtime = w.runtime
    follow(w.holder, w.gateway, w.fleet, w.collector, ops, lambda new: setattr(runtime, "cfg", new))
    ops.start()


async def stop_maintenance(w: Wiring) -> None:
    await w.ops.stop()


async def start_discovery(w: Wiring) -> None:
    # Discovery (kubernetes, dns) changes the backend list while serving; static: None.
    w.discovery = discovery = make_discovery(w.cfg)
    if discovery is not None:
        discovery.on_change.append(follow_backends(w.holder))
        await discovery.start()
    w.app.state.discovery = discovery


async def stop_discovery(w: Wiring) -> None:
    if w.discovery is not None:
        await w.discovery.stop()


async def start_reloads(w: Wiring) -> None:
    # POST /admin/reload and SIGHUP re-read the config file (proxy.api.reload).
    w.reloader = w.runtime.reloader = Reloader(
        w.holder,
        ReloadMetrics(w.metrics.registry),
        prepare=[load_sizer],
        adjust=keep_discovered(w.discovery),
    )
    if w.reload_on_hup:
        w.sighup.enter_context(w.reloader.on_sighup())


async def stop_reloads(w: Wiring) -> None:
    w.sighup.close()


async def get_ready(w: Wiring) -> None:
    with contextlib.suppress(Exception):
        await w.fleet.snapshot(force=True)
    if w.freeze_heap:
        log.debug("froze %d objects of the startup heap", freeze_startup_heap())
    n = len(w.cfg.backends)
    s = "" if n == 1 else "s"
    log.info("kvroute gateway ready: %d backend%s, policy %s", n, s, w.cfg.routing.policy)


def owner_id(app: FastAPI) -> str:
    """This process's and app's name in the shared store (reservations, restarts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{id(app):x}"


GATEWAY_COMPONENTS: list[Component[Wiring]] = [
    Component("tokenizers", load_tokenizers),
    Component("store", open_the_store, close_the_store),
    Component("fleet view", start_fleet_view),
    Component("upstream pool", start_upstream, close_upstream),
    Component("gateway", start_gateway, close_gateway),
    Component("replica lease", start_lease, stop_lease),
    Component("prefix share", start_prefix_share, close_prefix_share),
    Component("kv events", start_kv_events, stop_kv_events),
    Component("collector", start_collector, stop_collector),
    Component("maintenance", start_maintenance, stop_maintenance),
    Component("discovery", start_discovery, stop_discovery),
    Component("reloads", start_reloads, stop_reloads),
    Component("ready", get_ready),
]
