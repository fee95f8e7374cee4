"""The one door of an inference request: a ``POST`` to ``/v1/chat/completions`` or ``/v1/completions``.

Under kvroute's own server settings (``proxy.api.server``, what ``kvroute serve`` and the
tests run) the HTTP protocol hands such a request straight to ``LeanPath.run``, past the
ASGI cycle: about a third of the gateway's CPU per tiny request went to the layers between
the socket and ``Gateway.handle`` (docs/benchmarks.md, Issue 12): uvicorn's proxy-header
middleware, the app's ``__call__``, the access log and the guard as ASGI middleware (each
wrapping ``receive``/``send`` in closures), the body read through ASGI messages under a
timeout, Starlette's ``Response.__call__`` with its two ``send`` messages, and uvicorn's
``send``, which checks every header with two regular expressions and writes the head
apart from the body. Here one coroutine runs:

* the same proxy-header rewrite (uvicorn's own middleware, run on the scope, for a request
  that carries ``X-Forwarded-For`` or ``X-Forwarded-Proto``);
* the same guard (``RequestGuard.header_refusal`` and ``with_body``: header size, one
  Authorization header, API key in constant time, body size, time and rate, the buffered
  body budget, the concurrency slot); a body that is already in full is taken without a
  wait (``whole_body``), otherwise it is read through the cycle's ``receive`` with the
  guard's own deadlines (``read_body``);
* the handler (``handler_for``: ``Gateway.handle``) through ``answer_of``, the one place
  that turns a bug into the OpenAI-format 500;
* the answer written to the socket (``proxy.api.socket_answer``).

The same handlers, through the same ``answer_of``, are also plain routes of the app
(``GatewayApp.serve_inference``): the road for any ASGI server other than kvroute's, for a
uvicorn whose internals the lean path does not recognise, and for ``KVROUTE_LEAN=0`` (the
overhead benchmark's A/B). That road goes through the whole middleware stack, the same
guard instance included. There used to be two more doors (FastAPI's own route, and a
dispatch in the app's ``__call__`` past the framework's middleware); each served only the
non-lean road and each had to be fixed and tested apart (issue 24).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from proxy.api.access_log import PEEK_BYTES, continued_fields
from proxy.api.socket_answer import Seen, answer
from proxy.errors import ApiError
from proxy.gateway.intake import READ_BODY

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from proxy.api.access_log import AccessLog
    from proxy.api.limits import RequestGuard

log = logging.getLogger("kvroute.app")

Handler = Callable[[Request], Awaitable[Response]]
Endpoint = Literal["chat", "completions"]

#: The inference routes and the OpenAI endpoint each one serves.
INFERENCE_ROUTES: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


def internal_error() -> Response:
    """The answer to a bug: OpenAI's format, nothing of the exception's text (the one 500)."""
    return ApiError(
        500, "internal gateway error", type="server_error", code="internal_error"
    ).response()


def handler_for(endpoint: Endpoint) -> Handler:
    """The handler of one inference route: the gateway's walk (``Gateway.handle``).

    A plain function handing back the walk's own coroutine: one coroutine fewer on every
    request's path (each level is entered again at every resumption)."""

    def handle(request: Request) -> Awaitable[Response]:
        gateway: Any = request.app.state.rt.gateway
        walk: Awaitable[Response] = gateway.handle(request, endpoint)
        return walk

    handle.__name__ = endpoint
    return handle


async def answer_of(handler: Handler, request: Request) -> Response:
    """The handler's answer; an unexpected error is logged and answered ``internal_error``."""
    try:
        return await handler(request)
    except Exception:
        log.exception("unexpected error on %s", request.scope.get("path"))
        return internal_error()


#: What the lean path reads and sets on uvicorn's ``RequestResponseCycle`` (its internals,
#: as tested with uvicorn 0.54): checked on the first request; without them the lean path stays off.
CYCLE_PARTS = (
    "scope", "body", "more_body", "message_event", "flow", "receive", "send",
    "response_started", "response_complete", "waiting_for_100_continue", "keep_alive",
    "disconnected", "default_headers", "on_response", "send_500_response",
)  # fmt: skip


def missing_cycle_parts(cycle: object) -> list[str]:
    """The parts of ``CYCLE_PARTS`` this uvicorn's cycle does not have."""
    return [name for name in CYCLE_PARTS if not hasattr(cycle, name)]


#: The headers uvicorn's proxy-header layer reads (names lowercased, as uvicorn stores them).
FORWARDED_HEADERS = (b"x-forwarded-for", b"x-forwarded-proto")


def forwarded(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request carries a header the proxy-header layers read: without one they
    change nothing, so the lean path skips them (two coroutines per request, ~3% of a tiny
    request's CPU)."""
    for name, _ in headers:
        if name in FORWARDED_HEADERS:
            return True
    return False


class LeanApp(Protocol):
    """What the lean path reads of ``proxy.api.gateway_app.GatewayApp`` (which imports this
    module: a protocol here keeps the two out of an import circle)."""

    inference_routes: dict[str, Handler]
    guard: RequestGuard | None
    access_log: AccessLog | None


class LeanPath:
    """The lean path for one server (one per app, found from uvicorn's loaded app)."""

    def __init__(self, app: LeanApp, proxies: list[ProxyHeadersMiddleware]) -> None:
        self.app = app
        self.proxies = proxies

    def handler(self, scope: Scope) -> Handler | None:
        """The handler serving this request on the lean path; None: the ASGI stack serves it."""
        if scope["method"] != "POST":
            return None
        handler = self.app.inference_routes.get(scope["path"])
        if handler is None or self.app.guard is None:
            return None
        return handler

    def run(
        self, cycle: RequestResponseCycle, transport: asyncio.Transport, handler: Handler
    ) -> Coroutine[Any, Any, None]:
        """Serve one request: the guard, the handler, the answer; like ``cycle.run_asgi``.

        With the access log on, its line is written when the answer's last byte is out.
        (The coroutine to run, not one around it: each level is entered again at every
        resumption.)
        """
        access = self.app.access_log
        if access is None or not access.enabled:
            return self._run(cycle, transport, handler, None)
        return self._logged(cycle, transport, handler, access)

    async def _logged(
        self,
        cycle: RequestResponseCycle,
        transport: asyncio.Transport,
        handler: Handler,
        access: AccessLog,
    ) -> None:
        started = time.perf_counter()
        seen = Seen()
        try:
            await self._run(cycle, transport, handler, seen)
        finally:
            seconds = time.perf_counter() - started
            fields = seen.fields | continued_fields(cycle.scope)  # type: ignore[arg-type]
            access.write(cycle.scope["path"], seen.head, fields, seen.status, seconds)

    async def _run(
        self,
        cycle: RequestResponseCycle,
        transport: asyncio.Transport,
        handler: Handler,
        seen: Seen | None,
    ) -> None:
        try:
            await self._serve(cycle, transport, handler, seen)
        except BaseException as exc:
            log.error("Exception in the lean path", exc_info=exc)
            if not cycle.response_started:
                await cycle.send_500_response()
            else:
                transport.close()
        else:
            if not cycle.response_complete and not cycle.disconnected:
                # A stream cut short (its deadline): closing the connection ends it for the client.
                transport.close()
        finally:
            cycle.on_response = lambda: None

    async def _serve(
        self,
        cycle: RequestResponseCycle,
        transport: asyncio.Transport,
        handler: Handler,
        seen: Seen | None,
    ) -> None:
        scope: Scope = cycle.scope  # type: ignore[assignment]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self.proxies and forwarded(headers):
            for proxy in self.proxies:
                await proxy(scope, cycle.receive, cycle.send)  # type: ignore[arg-type]
        scope["app"] = self.app
        guard = self.app.guard
        assert guard is not None

        async def refuse(err: ApiError) -> None:
            await answer(cycle, transport, err.response(), seen)

        refusal = guard.header_refusal(headers, scope["path"])
        if refusal is not None:
            guard.refused[refusal[1]] += 1
            await refuse(refusal[0])
            return

        async def read() -> tuple[bytes, int]:
            if not cycle.more_body and not cycle.waiting_for_100_continue:
                # The whole body came with the headers (a small request): take it as is.
                body = bytes(cycle.body)
                cycle.body = bytearray()
                cycle.message_event.clear()
                cycle.flow.resume_reading()
                return guard.whole_body(headers, body)
            return await guard.read_body(headers, cycle.receive)  # type: ignore[arg-type]

        async def run(body: bytes) -> None:
            scope[READ_BODY] = body
            if seen is not None:
                seen.head = body[:PEEK_BYTES]
            request = Request(scope, cycle.receive)  # type: ignore[arg-type]
            await answer(cycle, transport, await answer_of(handler, request), seen)

        await guard.with_body(read, run, refuse)
