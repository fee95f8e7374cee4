"""Operations endpoints: admin actions (drain, undrain, restart), advice, events, status page.

Admin actions need the admin key (``admin.api_key`` / ``KVROUTE_ADMIN_KEY``), sent as
``Authorization: Bearer KEY`` or ``X-Admin-Key: KEY`` and compared in constant time. With no
key configured they answer 404: disabled, not merely forbidden. So does the OpenAPI
document (``/openapi.json``): it lists the admin routes. The read-only endpoints
(``/fleet/advice``, ``/fleet/events``, the status page at ``/``) are open like ``/fleet``;
their answers are cached for up to a second (``proxy.api.cache``) so a flood of them costs
one computation per second, and events carry no hook output or URL (those go to the log).
"""

from __future__ import annotations

import hmac
from functools import lru_cache
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from proxy.api.cache import Coalesced
from proxy.api.worker_peers import FANOUT_HEADER, combined, credentials
from proxy.errors import ApiError, RefusalReason, RestartRefused
from proxy.ops.maintenance import Maintenance, partitioned_slots
from proxy.ops.preemption_advice import preemption_advice
from proxy.ops.slot_advice import slot_layout_advice
from proxy.state.base import StoreUnavailable

STATUS_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _json(data: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(data),
        status_code=status,
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _ops(request: Request) -> Maintenance:
    ops: Maintenance = request.app.state.ops
    return ops


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get("x-admin-key")
    return key if key else None


def check_admin(request: Request) -> Response | None:
    """None when the request may act; else the error response (404 disabled, 401, 403)."""
    configured = request.app.state.rt.cfg.admin.api_key
    if not configured:
        return ApiError(
            404,
            "admin endpoints are disabled: set admin.api_key (or KVROUTE_ADMIN_KEY) to enable them",
            type="not_found",
            code="admin_disabled",
        ).response()
    given = presented_key(request)
    if given is None:
        return ApiError(
            401,
            "admin key required: send 'Authorization: Bearer KEY' or 'X-Admin-Key: KEY'",
            type="authentication_error",
            code="admin_key_missing",
            headers={"www-authenticate": 'Bearer realm="kvroute-admin"'},
        ).response()
    if not hmac.compare_digest(given.encode("utf-8"), configured.encode("utf-8")):
        return ApiError(
            403, "wrong admin key", type="permission_error", code="admin_key_invalid"
        ).response()
    return None


# Why a restart or drain was refused -> (HTTP status, error type and code). The domain error
# carries no status; this is the one place that turns it into HTTP.
REFUSAL_ANSWERS: dict[RefusalReason, tuple[int, str]] = {
    "unknown_backend": (404, "not_found"),
    "conflict": (409, "conflict"),
    "store_unavailable": (503, "conflict"),
}


def _refused(exc: RestartRefused) -> Response:
    status, kind = REFUSAL_ANSWERS[exc.reason]
    return ApiError(status, exc.message, type=kind, code=kind).response()


@lru_cache(maxsize=1)
def status_page() -> bytes:
    return resources.files("proxy.api").joinpath("static/status.html").read_bytes()


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes")


# How old an open read endpoint's answer may be (advice and events change every few seconds).
READ_CACHE_S = 1.0


async def openapi(request: Request) -> Response:
    if (denied := check_admin(request)) is not None:
        return denied
    return _json(request.app.openapi())


async def reload(request: Request) -> Response:
    if (denied := check_admin(request)) is not None:
        return denied
    outcome = await request.app.state.rt.reloader.reload("POST /admin/reload")
    peers = getattr(request.app.state, "worker_peers", None)
    if peers is not None and request.headers.get(FANOUT_HEADER) != "0":
        # --workers N: every other worker reloads too, each reports (proxy.api.worker_peers).
        others = await peers.reload_others(credentials(request.headers))
        return _json(*combined(outcome.as_dict(), others))
    # 422: the file is invalid and nothing changed; the body says what is wrong.
    return _json(outcome.as_dict(), 422 if outcome.result == "invalid" else 200)


async def drain(name: str, request: Request) -> Response:
    if (denied := check_admin(request)) is not None:
        return denied
    try:
        await _ops(request).set_draining(name, True)
    except RestartRefused as exc:
        return _refused(exc)
    return _json({"backend": name, "draining": True})


async def undrain(name: str, request: Request) -> Response:
    if (denied := check_admin(request)) is not None:
        return denied
    ops = _ops(request)
    if name in ops.restarting and not _flag(request, "force"):
        return _refused(
            RestartRefused(
                "conflict",
                f"{name} is being restarted; it returns to service by itself (add ?force=true to undrain now)",
            )
        )
    try:
        await ops.set_draining(name, False)
    except RestartRefused as exc:
        return _refused(exc)
    return _json({"backend": name, "draining": False})


async def restart(name: str, request: Request) -> Response:
    if (denied := check_admin(request)) is not None:
        return denied
    try:
        started = await _ops(request).request_restart(name, force=_flag(request, "force"))
    except RestartRefused as exc:
        return _refused(exc)
    return _json(started, 202)


async def index(request: Request) -> Response:
    return Response(
        status_page(),
        media_type="text/html; charset=utf-8",
        headers={
            "cache-control": "no-cache",
            "content-security-policy": STATUS_PAGE_CSP,
            "x-content-type-options": "nosniff",
        },
    )


class OpsReads:
    """The open read endpoints of operations, each answer shared for ``READ_CACHE_S``."""

    def __init__(self) -> None:
        self.advice_cache: Coalesced[bytes] = Coalesced(READ_CACHE_S)
        self.events_cache: Coalesced[list[dict[str, Any]]] = Coalesced(READ_CACHE_S)

    async def advice(self, request: Request) -> Response:
        ops = _ops(request)

        async def compute() -> bytes:
            body = (await ops.evaluate()).to_json()
            body["maintenance"] = {
                "enabled": ops.settings.enabled,
                "acts": ops.acts,
                "hook": ops.hook.kind,
                "restarting": ops.restarting,
                "max_concurrent_restarts": ops.settings.max_concurrent_restarts,
            }
            rt = request.app.state.rt
            snap = rt.fleet.latest
            if snap is not None:
                # Long pool vs general pool by expected wait (queueing backends).
                body["pools"] = rt.gateway.queues.pool_advice(snap, rt.store.now())
            # Preemptions under the projection: which nodes the gateway fills less, and why.
            body["memory_pressure"] = preemption_advice(rt.gateway.pressure.headroom, snap)
            # llama.cpp servers whose slots are each too small for what failed there.
            body["slot_layout"] = slot_layout_advice(
                partitioned_slots(rt.cfg),
                ops.failures.recent(rt.store.now(), ops.settings.failure_window_s),
                snap,
            )
            return orjson.dumps(body)

        payload = await self.advice_cache.get("advice", compute)
        return Response(
            payload, media_type="application/json", headers={"cache-control": "no-store"}
        )

    async def events(self, request: Request) -> Response:
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            return ApiError(
                400, "limit must be an integer within 1..1000", param="limit", code="invalid_value"
            ).response()
        backend = request.query_params.get("backend")
        store = _ops(request).store
        try:
            items = await self.events_cache.get(int(raw), lambda: store.events(int(raw)))
        except StoreUnavailable:
            return ApiError(
                503, "state store unavailable", type="server_error", code="store_unavailable"
            ).response()
        if backend:
            items = [e for e in items if e.get("backend") == backend]
        return _json({"events": items})


def ops_router() -> APIRouter:
    """Admin actions, ``/fleet/advice``, ``/fleet/events`` and the status page at ``/``."""
    router = APIRouter()
    reads = OpsReads()
    router.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    router.add_api_route("/admin/reload", reload, methods=["POST"])
    router.add_api_route("/admin/backends/{name}/drain", drain, methods=["POST"])
    router.add_api_route("/admin/backends/{name}/undrain", undrain, methods=["POST"])
    router.add_api_route("/admin/backends/{name}/restart", restart, methods=["POST"])
    router.add_api_route("/fleet/advice", reads.advice, methods=["GET"])
    router.add_api_route("/fleet/events", reads.events, methods=["GET"])
    router.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    return router
