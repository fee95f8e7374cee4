"""Wiring: the ASGI app, its lifespan (the components of ``proxy.api.wiring``) and its routes.

No business logic here. ``create_app`` reads top to bottom: the components that start and
stop with the app, the middleware (outermost last), the error answers, then the routes:
admin and fleet (``proxy.api.admin``), the inference door (``proxy.api.entry``) and the
open read endpoints (``proxy.api.read_routes``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.api.access_log import AccessLog
from proxy.api.admin import ops_router
from proxy.api.drain import Drain, ready
from proxy.api.entry import internal_error
from proxy.api.gateway_app import GatewayApp
from proxy.api.lifecycle import started
from proxy.api.limits import RequestGuard
from proxy.api.read_routes import read_router
from proxy.api.reload import ConfigHolder
from proxy.api.wiring import GATEWAY_COMPONENTS, Wiring
from proxy.config import Config
from proxy.errors import ApiError
from proxy.state.base import StateStore

log = logging.getLogger("kvroute.app")


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
        wiring = Wiring(app, holder, store, run_collector, freeze_heap, reload_on_hup, drain)
        async with started(GATEWAY_COMPONENTS, wiring):
            yield

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

    def follow_reloads(fn: Callable[[Config], None]) -> None:
        holder.subscribe(lambda old, new: fn(new))

    # Both follow reloads. Added last = outermost: the access log times the whole request.
    # The guard: header size, client API keys, the body, concurrency limit (proxy.api.limits).
    app.add_middleware(RequestGuard, cfg=cfg, follow=follow_reloads)
    app.add_middleware(AccessLog, cfg=cfg, follow=follow_reloads)
    add_error_answers(app)
    # Admin actions, /fleet/advice, /fleet/events, the status page at /.
    app.include_router(ops_router())
    # POST /v1/chat/completions and /v1/completions: one door (proxy.api.entry).
    app.serve_inference()
    app.include_router(read_router())
    return app


def add_error_answers(app: FastAPI) -> None:
    """Framework errors and bugs outside the inference door, answered in OpenAI's format."""

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
        return internal_error()
