"""The open read endpoints: ``/v1/models``, ``/health``, ``/metrics`` and ``/fleet``.

``/metrics`` and ``/fleet`` are coalesced: callers that arrive while an answer is being
computed share it, so a flood costs one computation at a time (proxy.api.cache); answers
stay live (age 0).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from proxy.api.cache import Coalesced
from proxy.api.fleet_view import (
    collector_json,
    replicas_json,
    snapshot_json,
    with_health,
    with_scrapes,
)
from proxy.api.kv_events_view import with_prefix_source
from proxy.api.model_listing import fleet_models
from proxy.api.node_counts import node_counts, with_counts
from proxy.api.wiring import Runtime
from proxy.backends.kv_events import KvEventFeeds


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def rt(request: Request) -> Runtime:
    r: Runtime = request.app.state.rt
    return r


async def _backend_models(r: Runtime, name: str) -> list[dict[str, Any]]:
    """One backend's ``/v1/models`` entries (none when it cannot be asked)."""
    try:
        url = r.gateway.urls[name] + "/v1/models"
        status, body = await r.upstream.get(url, 2.0, r.gateway.auth_headers(name))
        data = orjson.loads(body) if status == 200 else {}
        items = data.get("data", []) if isinstance(data, dict) else []
        return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except Exception:
        return []


async def list_models(request: Request) -> Response:
    r = rt(request)
    now = time.monotonic()
    if r.models_cache is not None and now - r.models_cache[0] < 5.0:
        return Response(r.models_cache[1], media_type="application/json")
    listed = fleet_models(r.cfg, r.gateway.models_info, int(r.started_at))
    if listed is not None:
        return _json(listed)
    snap = await r.fleet.snapshot()
    up = [n.name for n in snap.nodes if n.up]
    merged: dict[str, dict[str, Any]] = {}
    for items in await asyncio.gather(*(_backend_models(r, n) for n in up)):
        for m in items:
            merged.setdefault(m["id"], m)
    payload = orjson.dumps({"object": "list", "data": list(merged.values())})
    r.models_cache = (now, payload)
    return Response(payload, media_type="application/json")


async def health(request: Request) -> Response:
    r = rt(request)
    snap = await r.fleet.snapshot()
    checks = r.gateway.health.snapshot()
    # Down: the collector cannot reach it, or the active health checks fail it.
    down = sorted(
        n.name for n in snap.nodes if not n.up or not checks.get(n.name, {}).get("healthy", True)
    )
    up = sum(1 for n in snap.nodes if n.up and n.report is not None and n.name not in down)
    if r.fleet.degraded or (down and up > 0):
        status = "degraded"
    elif up == 0:
        status = "no_backends"
    else:
        status = "ok"
    body = {
        "status": status,
        "store": "unreachable" if r.fleet.degraded else "ok",
        "backends_up": up,
        "backends_down": down,
        "backends": len(snap.nodes),
    }
    return _json(body, 200 if status != "no_backends" else 503)


async def fleet_json(r: Runtime, kv_events: KvEventFeeds | None) -> bytes:
    """``/fleet``: the live state (operators want it, not the router's cache)."""
    snap = await r.fleet.snapshot(force=True)
    scrapes = r.collector.status() if r.collector is not None else None
    return orjson.dumps(
        {
            "taken_at": snap.taken_at,
            "degraded": r.fleet.degraded,
            "policy": r.cfg.routing.policy,
            "config": r.reloader.describe() if r.reloader is not None else None,
            "queue_depth": r.gateway.admission.depth,
            # Whether this replica scrapes the backends (the collector lock), and its rounds.
            "collector": collector_json(scrapes),
            # What this replica still holds: a leak shows here before any TTL hides it.
            "reservations": {
                "held": len(r.gateway.ledger.held),
                "pending_releases": len(r.gateway.ledger.pending),
            },
            # Gateway replicas with a live lease, and what each reserves (proxy.state.lease).
            "replicas": await replicas_json(r.store, r.fleet.names, r.store.now()),
            # Each lazily allocating backend's KV projection (proxy.gateway.memory_pressure).
            "backends": r.gateway.pressure.annotate(
                with_counts(
                    with_prefix_source(
                        with_scrapes(
                            with_health(
                                snapshot_json(snap, r.store.now(), r.cfg),
                                r.gateway.health.snapshot(),
                            ),
                            scrapes,
                        ),
                        kv_events,
                        r.store.now(),
                    ),
                    node_counts(r.gateway.metrics.requests, r.gateway.metrics.attempts),
                )
            ),
            # Prompt counts against the servers' usage, per model (proxy.gateway.token_counts).
            "token_counts": r.gateway.token_counts.view(),
            # Output lengths learned for the KV projection.
            "memory_pressure": {
                "learned_output": r.gateway.pressure.learned_json(),
                # Tokens per second per request, as each backend's streams show it.
                "decode_tokens_per_s": {
                    name: round(rate, 1)
                    for name in r.gateway.pressure.decode.samples
                    if (rate := r.gateway.pressure.decode.rate(name)) is not None
                },
            },
            # The rates behind each queueing backend's expected wait, and their sources.
            "rates": r.gateway.queues.rates_json(snap, r.gateway.pressure.decode.rate),
            # Predicted against observed TTFT per backend, and whether the ranking runs blind
            # (proxy.routing.prediction_check).
            "ttft_model": r.gateway.ttft_check.check.to_json(),
        }
    )


def read_router() -> APIRouter:
    """The read endpoints (no admin key; ``/v1/models`` takes the client key like ``/v1/``)."""
    router = APIRouter()
    router.add_api_route("/v1/models", list_models, methods=["GET"], name="models")
    router.add_api_route("/health", health, methods=["GET"])
    live: Coalesced[bytes] = Coalesced(0.0)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        async def render() -> bytes:
            return generate_latest(rt(request).metrics.registry)

        return Response(await live.get("metrics", render), media_type=CONTENT_TYPE_LATEST)

    @router.get("/fleet")
    async def fleet(request: Request) -> Response:
        r = rt(request)
        kv_events = getattr(request.app.state, "kv_events", None)
        payload = await live.get("fleet", lambda: fleet_json(r, kv_events))
        return Response(payload, media_type="application/json")

    return router
