"""The two inference routes, dispatched ahead of the framework's middleware stack.

Profiled under wrk (docs/benchmarks.md, "Profile"), a tiny completion spent about a fifth
of the gateway's CPU in layers that do nothing for it: FastAPI's error, telemetry, body-limit
and exit-stack middleware, Starlette's exception middleware and route matching. Here a
``POST`` to ``/v1/chat/completions`` or ``/v1/completions`` goes straight from the app's
``__call__`` (FastAPI's own checks OpenTelemetry's providers on every request) to the
app's own middleware, the same instances (the access log, then the ``RequestGuard``: header
limits, API keys, the body budget and the concurrency count stay one), and from the guard
to the gateway's walk. Everything else, other
methods on these paths included, takes the full stack as before. Only the dispatch is
skipped: every request is still sized, ranked, reserved and released.

Under kvroute's own server settings (``proxy.api.server``) those requests do not reach
this app's ``__call__`` at all: the protocol's lean path (``proxy.api.lean``) runs the same
guard and the same handlers (``hot_routes``, ``answer_of``) past the ASGI cycle. This
dispatch serves them under any other ASGI server, and with ``KVROUTE_LEAN=0``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.access_log import AccessLog
from proxy.api.limits import RequestGuard
from proxy.errors import ApiError

log = logging.getLogger("kvroute.app")

Handler = Callable[[Request], Awaitable[Response]]


async def answer_of(handler: Handler, request: Request) -> Response:
    """The handler's answer; an unexpected error is the same 500 the full stack answers."""
    try:
        return await handler(request)
    except Exception:
        log.exception("unexpected error on %s", request.scope.get("path"))
        return ApiError(
            500, "internal gateway error", type="server_error", code="internal_error"
        ).response()


def plain_route(handler: Handler) -> ASGIApp:
    """``handler`` as an ASGI app (``answer_of``, then the response's own ASGI call)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await answer_of(handler, Request(scope, receive))
        await response(scope, receive, send)

    return app


def layers(stack: Any) -> list[Any]:
    """The layers of a built middleware stack, outermost first (each keeps the next as ``.app``)."""
    out: list[Any] = []
    node = stack
    while node is not None and len(out) < 32:
        out.append(node)
        node = getattr(node, "app", None)
    return out


def find_guard(stack: Any) -> RequestGuard | None:
    """The RequestGuard inside a built middleware stack."""
    return next((n for n in layers(stack) if isinstance(n, RequestGuard)), None)


def find_access_log(stack: Any) -> AccessLog | None:
    """The AccessLog inside a built middleware stack."""
    return next((n for n in layers(stack) if isinstance(n, AccessLog)), None)


class GatewayApp(FastAPI):
    """FastAPI, with a ``POST`` on an inference route handed straight to the app's own middleware.

    ``FastAPI.__call__`` (its OpenTelemetry provider checks, per request) and the framework's
    middleware around ours are skipped for those two routes; our own (``add_middleware``:
    the access log, the guard) all run, in their order, and the guard hands the request to
    the plain handler instead of the router. Everything else, other methods on these paths
    included, takes the full stack. Set ``hot_routes`` before serving.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hot_routes: dict[str, Handler] = {}
        self._guard: RequestGuard | None = None
        self._entry: ASGIApp | None = None
        # The server's lean path (proxy.api.lean) serves these routes past the same guard,
        # and leaves them to this stack while the access log is on.
        self.access_log: AccessLog | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack: ASGIApp = super().build_middleware_stack()
        ours = tuple(m.cls for m in self.user_middleware if isinstance(m.cls, type))
        found = layers(stack)
        # Without a guard in the stack, dispatching around the stack would skip its checks.
        guard = find_guard(stack)
        entry = next((n for n in found if ours and isinstance(n, ours)), None)
        if guard is not None and entry is not None:
            guard.hot = {path: plain_route(h) for path, h in self.hot_routes.items()}
            self._guard, self._entry = guard, entry
            self.access_log = find_access_log(stack)
        return stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard, entry = self._guard, self._entry
        if (
            guard is not None
            and entry is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in guard.hot
        ):
            scope["app"] = self
            await entry(scope, receive, send)
        else:
            # The first request builds the stack (and finds the guard) here.
            await super().__call__(scope, receive, send)
