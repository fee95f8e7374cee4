"""The ASGI app: FastAPI, plus what the inference requests' one door (``proxy.api.entry``) needs.

``serve_inference`` registers the inference handlers once, for both roads: the server's
lean path finds them in ``inference_routes``, and they are mounted as plain Starlette routes
(no dependency solving, each through ``answer_of``) for any other server. The middleware
stack, once built, tells the lean path which ``RequestGuard`` and ``AccessLog`` instances
are the app's own, so both roads count, refuse and log through the same ones.

The inference routes read the raw body themselves (the gateway forwards the exact bytes
and validates only what routing needs, proxy.core.validation), so their request schemas
are added to the OpenAPI document by hand (``openapi``).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from proxy.api.access_log import AccessLog
from proxy.api.entry import INFERENCE_ROUTES, Handler, answer_of, handler_for
from proxy.api.inference_schema import inference_paths
from proxy.api.limits import RequestGuard


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


def asgi_endpoint(handler: Handler) -> Any:
    """``handler`` as a Starlette endpoint whose bug is answered by ``answer_of`` too."""

    async def endpoint(request: Request) -> Response:
        return await answer_of(handler, request)

    endpoint.__name__ = getattr(handler, "__name__", "inference")
    return endpoint


class GatewayApp(FastAPI):
    """FastAPI with the inference routes registered once (``serve_inference``) for both roads.

    ``guard`` and ``access_log`` are the app's own middleware instances, found when the
    first request builds the stack (the lean path serves nothing before: ``guard`` None).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inference_routes: dict[str, Handler] = {}
        self.guard: RequestGuard | None = None
        self.access_log: AccessLog | None = None

    def serve_inference(self) -> None:
        """Register the inference handlers: for the lean path and as plain routes."""
        for path, endpoint in INFERENCE_ROUTES.items():
            handler = handler_for(endpoint)
            self.inference_routes[path] = handler
            self.router.routes.append(Route(path, asgi_endpoint(handler), methods=["POST"]))

    def build_middleware_stack(self) -> ASGIApp:
        stack: ASGIApp = super().build_middleware_stack()
        # Without the guard in the stack, the lean path would skip its checks: it stays off.
        self.guard = find_guard(stack)
        self.access_log = find_access_log(stack)
        return stack

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            doc = super().openapi()
            doc["paths"] = {**inference_paths(), **doc["paths"]}
        return self.openapi_schema  # type: ignore[return-value]


async def _nothing(scope: Scope, receive: Receive, send: Send) -> None:
    return None


def find_app(app: Any) -> tuple[GatewayApp, list[ProxyHeadersMiddleware]] | None:
    """The GatewayApp under uvicorn's wrappers, and the proxy-header layers above it.

    None when any other layer sits in between (a logger, an adapter): then the lean path
    would skip it, so it stays off.
    """
    proxies: list[ProxyHeadersMiddleware] = []
    node = app
    for _ in range(8):
        if isinstance(node, GatewayApp):
            return node, proxies
        if not isinstance(node, ProxyHeadersMiddleware):
            return None
        # The same trusted hosts, around nothing: it only rewrites the scope.
        lone = copy.copy(node)
        lone.app = _nothing  # type: ignore[assignment]
        proxies.append(lone)
        node = node.app
    return None
