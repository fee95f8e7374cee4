"""Wiring: the ASGI app, its lifespan (store, collector, upstream pool) and endpoints.

No business logic here. The two OpenAI endpoints are declared with their request schema
for the OpenAPI document but read the raw body themselves: the gateway forwards the exact
bytes and validates only what routing needs (see proxy.core.validation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.api.access_log import AccessLog
from proxy.api.admin import ops_router
from proxy.api.cache import Coalesced
from proxy.api.drain import Drain, ready
from proxy.api.fleet_view import snapshot_json, with_health
from proxy.api.heap import freeze_startup_heap
from proxy.api.hot import GatewayApp
from proxy.api.kind_check import KindCheck
from proxy.api.kv_events_view import with_prefix_source
from proxy.api.limits import RequestGuard
from proxy.api.models import fleet_models, kind_errors, lookup_from
from proxy.api.node_counts import node_counts, with_counts
from proxy.api.reconfigure import follow, policy_for
from proxy.api.reload import ConfigHolder, Reloader, ReloadMetrics
from proxy.backends.collector import Collector
from proxy.backends.discovery import Discovery, make_discovery
from proxy.backends.kv_events import KvEventFeeds
from proxy.backends.kv_events_metrics import KvEventsCollector
from proxy.config import BackendConfig, Config
from proxy.errors import ApiError
from proxy.gateway.metrics import GatewayMetrics
from proxy.gateway.sizing import load_sizer
from proxy.gateway.walk import Gateway
from proxy.ops.maintenance import Maintenance
from proxy.ops.metrics import OpsCollector
from proxy.state import open_store, with_local_fallback
from proxy.state.base import StateStore
from proxy.state.fleet_cache import FleetCache
from proxy.state.prefix_share import PrefixShare
from proxy.upstream.client import Upstream

log = logging.getLogger("kvroute.app")

_CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
        },
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
    },
}
_COMPLETIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
    },
}


def _body_spec(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@dataclass
class Runtime:
    """Everything the lifespan starts, reachable from handlers through app.state.rt."""

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


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def create_app(
    cfg: Config,
    store: StateStore | None = None,
    run_collector: bool = True,
    config_path: str | None = None,
    freeze_heap: bool = False,
    reload_on_hup: bool = True,
) -> FastAPI:
    """Build the gateway app. A store passed in is used as is (tests); else one is opened from config.
    With ``config_path``, SIGHUP and ``POST /admin/reload`` re-read that file (proxy.api.reload).
    With ``freeze_heap`` (``kvroute serve``: one app per process), what startup built is
    frozen out of the garbage collector's walks once it is ready (proxy.api.heap).
    ``reload_on_hup`` false: SIGHUP is left to the server, which stops (proxy.api.hangup)."""
    holder = ConfigHolder(cfg, config_path)
    # Shutdown state (proxy.api.drain): /ready, and the streams a drain's end interrupts.
    drain = Drain(lambda: holder.current.shutdown.drain_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Load the tokenizers now, off the loop: lazily, the first request would stall the loop ~0.4 s.
        await load_sizer(cfg)
        # A store opened here gets degraded mode: local scrapes and reservations while Redis is away.
        st = store if store is not None else with_local_fallback(open_store(cfg.store), cfg)
        # Times shared between replicas run on the store's clock: measure the offset first.
        with contextlib.suppress(Exception):
            await st.sync_clock()
        owner = f"{socket.gethostname()}:{os.getpid()}:{id(app):x}"
        metrics = GatewayMetrics()
        fleet = FleetCache(cfg, st)
        upstream = Upstream(cfg.upstream)
        await upstream.start()
        gateway = Gateway(cfg, st, fleet, policy_for(cfg), upstream, metrics, st.now)
        gateway.kind_errors = kind_errors  # each backend kind's adapter reads its errors
        await gateway.start()  # active health checks (proxy.upstream.health)
        drain.streams = gateway.live_streams
        # Replicas share prefix placements through Redis when configured (read at start only).
        share = PrefixShare.from_config(cfg, lambda: gateway.affinity, st.now)
        if share is not None:
            gateway.affinity.share = share
            share.start()
        app.state.prefix_share = share
        # KV-cache events, where backends publish them (docs/kv-events.md).
        kv_events = KvEventFeeds(lambda: holder.current, lambda: fleet.latest, st.now)
        if cfg.routing.prefix.events.enabled:
            gateway.affinity.exact = kv_events
            metrics.registry.register(KvEventsCollector(kv_events))
            kv_events.start()
        app.state.kv_events = kv_events if gateway.affinity.exact is not None else None
        collector = Collector(cfg, st, owner) if run_collector else None
        metrics.attach_fleet(lambda: fleet.latest, st.now)
        fleet.on_degraded_change.append(lambda d: metrics.store_degraded.set(1 if d else 0))
        if collector is not None:
            gateway.models_info = lookup_from(collector.models)
            collector.on_report.append(lambda name, report: gateway.admission.notify())
            collector.on_report.append(KindCheck(lambda: app.state.rt.cfg).on_report)
            collector.start()
        app.state.rt = Runtime(cfg, st, fleet, gateway, collector, upstream, metrics, owner)
        ops = Maintenance(
            cfg, st, fleet, owner, clock=st.now
        )  # diagnosis, advice, drain + restart (proxy.ops.maintenance)
        gateway.on_allocation_failure.append(ops.on_allocation_failure)
        if collector is not None:
            collector.on_report.append(ops.on_report)
        metrics.registry.register(OpsCollector(ops, st.now))
        app.state.ops = ops
        runtime: Runtime = app.state.rt
        follow(holder, gateway, fleet, collector, ops, lambda new: setattr(runtime, "cfg", new))
        # Discovery (kubernetes, dns) changes the backend list while serving; static: None.
        discovery: Discovery | None = make_discovery(cfg)
        if discovery is not None:
            discovery.on_change.append(follow_backends(holder))
            await discovery.start()
        app.state.discovery = discovery
        ops.start()
        reloader = runtime.reloader = Reloader(
            holder,
            ReloadMetrics(metrics.registry),
            prepare=[load_sizer],
            adjust=keep_discovered(discovery),
        )
        with contextlib.suppress(Exception):
            await fleet.snapshot(force=True)
        if freeze_heap:
            log.debug("froze %d objects of the startup heap", freeze_startup_heap())
        n = len(cfg.backends)
        log.info(
            "kvroute gateway ready: %d backend%s, policy %s",
            n,
            "" if n == 1 else "s",
            cfg.routing.policy,
        )
        try:
            with reloader.on_sighup() if reload_on_hup else contextlib.nullcontext():
                yield
        finally:
            if discovery is not None:
                await discovery.stop()
            await ops.stop()
            if collector is not None:
                await collector.stop()
            await gateway.close()  # stops health checks, releases every reservation still held
            if share is not None:
                await share.close()
            await kv_events.stop()
            await upstream.close()
            if store is None:
                await st.close()

    # No public OpenAPI document (it lists the admin routes): /openapi.json is served to the
    # admin key only (proxy.api.admin), and there is no /docs page.
    app = GatewayApp(
        title="kvroute",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.drain = drain
    app.add_api_route("/ready", ready, methods=["GET"], include_in_schema=False)

    # Both follow reloads. Added last = outermost: the access log times the whole request.
    def follow_reloads(fn: Callable[[Config], None]) -> None:
        holder.subscribe(lambda old, new: fn(new))

    # Header size, client API keys, concurrency limit (proxy.api.limits).
    app.add_middleware(RequestGuard, cfg=cfg, follow=follow_reloads)
    app.add_middleware(AccessLog, cfg=cfg, follow=follow_reloads)
    app.include_router(
        ops_router()
    )  # admin actions, /fleet/advice, /fleet/events, status page at /

    def rt(request: Request) -> Runtime:
        r: Runtime = request.app.state.rt
        return r

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind, code=kind).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, "invalid request", code="invalid_request").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return ApiError(
            500, "internal gateway error", type="server_error", code="internal_error"
        ).response()

    @app.post("/v1/chat/completions", openapi_extra=_body_spec(_CHAT_SCHEMA))
    async def chat(request: Request) -> Response:
        return await rt(request).gateway.handle(request, "chat")

    @app.post("/v1/completions", openapi_extra=_body_spec(_COMPLETIONS_SCHEMA))
    async def completions(request: Request) -> Response:
        return await rt(request).gateway.handle(request, "completions")

    # The two hot routes are also mounted as plain Starlette routes ahead of FastAPI's, so a
    # request skips FastAPI's dependency solving (measured: about a third of the gateway's CPU
    # per request, docs/benchmarks.md). FastAPI's declarations above stay for the OpenAPI schema.
    app.router.routes[0:0] = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    # And a POST on them skips the middleware stack too, past the same guard (proxy.api.hot).
    app.hot_routes = {"/v1/chat/completions": chat, "/v1/completions": completions}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = rt(request)
        now = time.monotonic()
        if r.models_cache is not None and now - r.models_cache[0] < 5.0:
            return Response(r.models_cache[1], media_type="application/json")
        listed = fleet_models(r.cfg, r.gateway.models_info, int(r.started_at))
        if listed is not None:
            return _json(listed)
        snap = await r.fleet.snapshot()
        up = [n.name for n in snap.nodes if n.up]

        async def one(name: str) -> list[dict[str, Any]]:
            try:
                url = r.gateway.urls[name] + "/v1/models"
                status, body = await r.upstream.get(url, 2.0, r.gateway.auth_headers(name))
                data = orjson.loads(body) if status == 200 else {}
                items = data.get("data", []) if isinstance(data, dict) else []
                return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]
            except Exception:
                return []

        merged: dict[str, dict[str, Any]] = {}
        for items in await asyncio.gather(*(one(n) for n in up)):
            for m in items:
                merged.setdefault(m["id"], m)
        payload = orjson.dumps({"object": "list", "data": list(merged.values())})
        r.models_cache = (now, payload)
        return Response(payload, media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        r = rt(request)
        snap = await r.fleet.snapshot()
        health = r.gateway.health.snapshot()
        # Down: the collector cannot reach it, or the active health checks fail it.
        down = sorted(
            n.name
            for n in snap.nodes
            if not n.up or not health.get(n.name, {}).get("healthy", True)
        )
        up = sum(1 for n in snap.nodes if n.up and n.report is not None and n.name not in down)
        if r.fleet.degraded or (down and up > 0):
            status = "degraded"
        elif up == 0:
            status = "no_backends"
        else:
            status = "ok"
        return _json(
            {
                "status": status,
                "store": "unreachable" if r.fleet.degraded else "ok",
                "backends_up": up,
                "backends_down": down,
                "backends": len(snap.nodes),
            },
            200 if status != "no_backends" else 503,
        )

    # Open read endpoints: callers that arrive while an answer is being computed share it, so
    # a flood costs one computation at a time (proxy.api.cache); answers stay live (age 0).
    live: Coalesced[bytes] = Coalesced(0.0)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        async def render() -> bytes:
            return generate_latest(rt(request).metrics.registry)

        return Response(await live.get("metrics", render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet")
    async def fleet(request: Request) -> Response:
        r = rt(request)

        async def render() -> bytes:
            # Operators want the live state, not the router's cache.
            snap = await r.fleet.snapshot(force=True)
            return orjson.dumps(
                {
                    "taken_at": snap.taken_at,
                    "degraded": r.fleet.degraded,
                    "policy": r.cfg.routing.policy,
                    "config": r.reloader.describe() if r.reloader is not None else None,
                    "queue_depth": r.gateway.admission.depth,
                    # What this replica still holds: a leak shows here before any TTL hides it.
                    "reservations": {
                        "held": len(r.gateway.ledger.held),
                        "pending_releases": len(r.gateway.ledger.pending),
                    },
                    "backends": r.gateway.pressure.annotate(
                        with_counts(
                            with_prefix_source(
                                with_health(
                                    snapshot_json(snap, r.store.now(), r.cfg),
                                    r.gateway.health.snapshot(),
                                ),
                                getattr(request.app.state, "kv_events", None),
                                r.store.now(),
                            ),
                            node_counts(r.gateway.metrics.requests, r.gateway.metrics.attempts),
                        )
                    ),
                    # Prompt counts against the servers' usage, per model (proxy.gateway.token_counts).
                    "token_counts": r.gateway.token_counts.view(),
                    # Output lengths learned for the KV projection (proxy.gateway.memory_pressure).
                    "memory_pressure": {"learned_output": r.gateway.pressure.learned_json()},
                }
            )

        return Response(await live.get("fleet", render), media_type="application/json")

    return app
