"""The two inference routes, dispatched ahead of the framework's middleware stack.

Profiled under wrk (docs/benchmarks.md, "Profile"), a tiny completion spent about a fifth
of the gateway's CPU in layers that do nothing for it: FastAPI's error, telemetry, body-limit
and exit-stack middleware, Starlette's exception middleware and route matching. Here a
``POST`` to ``/v1/chat/completions`` or ``/v1/completions`` goes straight to the app's own
``RequestGuard`` (the same instance, so header limits, API keys, the body budget and the
concurrency count stay one) and from it to the gateway's walk. Everything else, other
methods on these paths included, takes the full stack as before. Only the dispatch is
skipped: every request is still sized, ranked, reserved and released.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.limits import RequestGuard
from proxy.errors import ApiError

log = logging.getLogger("kvroute.app")

Handler = Callable[[Request], Awaitable[Response]]


def plain_route(handler: Handler) -> ASGIApp:
    """``handler`` as an ASGI app; an unexpected error is the same 500 the full stack answers."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception:
            log.exception("unexpected error on %s", scope.get("path"))
            response = ApiError(
                500, "internal gateway error", type="server_error", code="internal_error"
            ).response()
        await response(scope, receive, send)

    return app


def find_guard(stack: Any) -> RequestGuard | None:
    """The RequestGuard inside a built middleware stack (each layer keeps the next as ``.app``)."""
    node = stack
    for _ in range(32):
        if isinstance(node, RequestGuard):
            return node
        node = getattr(node, "app", None)
        if node is None:
            return None
    return None


class HotRoutes:
    """Outermost ASGI layer: hot ``POST`` paths to the guard's fast lane, the rest to ``full``."""

    def __init__(self, full: ASGIApp, guard: RequestGuard, routes: dict[str, Handler]) -> None:
        self.full = full
        self.guard = guard
        guard.hot = {path: plain_route(h) for path, h in routes.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.guard.hot
        ):
            await self.guard(scope, receive, send)
        else:
            await self.full(scope, receive, send)


def install(app: Any, routes: dict[str, Handler]) -> None:
    """Put ``HotRoutes`` in front of ``app``'s middleware stack when Starlette builds it."""
    build = app.build_middleware_stack

    def build_with_hot_routes() -> ASGIApp:
        full: ASGIApp = build()
        guard = find_guard(full)
        if guard is None:
            # No guard in the stack: dispatching around it would skip its checks.
            return full
        return HotRoutes(full, guard, routes)

    app.build_middleware_stack = build_with_hot_routes
