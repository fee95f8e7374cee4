"""The lean path: a POST to an inference route served by the server protocol itself.

Under wrk, about a third of the gateway's CPU per tiny request went to layers between the
socket and ``Gateway.handle`` (docs/benchmarks.md, Issue 12): uvicorn's proxy-header
middleware, the app's ``__call__``, the access log and the guard as ASGI middleware (each
wrapping ``receive``/``send`` in closures), the body read through ASGI messages under a
timeout, Starlette's ``Response.__call__`` with its two ``send`` messages, and uvicorn's
``send``, which checks every header with two regular expressions and writes the head
apart from the body. Here, for a ``POST`` to ``/v1/chat/completions`` or
``/v1/completions``, the protocol (``proxy.api.server``) runs one coroutine instead:

* the same proxy-header rewrite (uvicorn's own middleware, run on the scope);
* the same guard (``RequestGuard.header_refusal`` and ``with_body``: header size, one
  Authorization header, API key in constant time, body size, time and rate, the buffered
  body budget, the concurrency slot); a body that is already in full is taken without a
  wait (``whole_body``), otherwise it is read through the cycle's ``receive`` with the
  guard's own deadlines (``read_body``);
* the same handler (``GatewayApp.hot_routes``) with the same 500 for a bug in it;
* a whole answer (any non-streaming response) written in one ``transport.write``, head and
  body together; a relayed stream written chunk by chunk (``relay``: chunked encoding, the
  head with the first chunk, uvicorn's flow control before each write so a client that
  stops reading pauses the relay), under the same deadline and the same ``ClientWatch`` on
  the cycle's ``receive`` (``RelayResponse.relay_to``), so a client that leaves still ends
  the stream, its upstream connection and its reservation.

With the access log on (``log.access_log``), its line is written here, from the same
fields (``AccessLog.write``). Everything else (other paths and methods, a server under
uvicorn's own ``limit_concurrency``) takes the ASGI stack unchanged. ``KVROUTE_LEAN=0``
turns the lean path off (the overhead benchmark's A/B).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from proxy.api.access_log import PEEK_BYTES, continued_fields, fields_of
from proxy.api.hot import GatewayApp, Handler, answer_of
from proxy.errors import ApiError
from proxy.gateway.intake import READ_BODY
from proxy.gateway.relay import RelayResponse

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

log = logging.getLogger("kvroute.app")


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


class Seen:
    """What the access log's line needs of one request (status 0: no answer started)."""

    __slots__ = ("fields", "head", "status")

    def __init__(self) -> None:
        self.status = 0
        self.head = b""
        self.fields: dict[str, str] = {}


class LeanPath:
    """The lean path for one server (one per app, found from uvicorn's loaded app)."""

    def __init__(self, app: GatewayApp, proxies: list[ProxyHeadersMiddleware]) -> None:
        self.app = app
        self.proxies = proxies

    def handler(self, scope: Scope) -> Handler | None:
        """The handler serving this request on the lean path; None: the ASGI stack serves it."""
        if scope["method"] != "POST":
            return None
        handler = self.app.hot_routes.get(scope["path"])
        if handler is None or self.app._guard is None:
            return None
        return handler

    async def run(
        self, cycle: RequestResponseCycle, transport: asyncio.Transport, handler: Handler
    ) -> None:
        """Serve one request: the guard, the handler, the answer; like ``cycle.run_asgi``.

        With the access log on, its line is written when the answer's last byte is out.
        """
        access = self.app.access_log
        if access is None or not access.enabled:
            await self._run(cycle, transport, handler, None)
            return
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
        for proxy in self.proxies:
            await proxy(scope, cycle.receive, cycle.send)  # type: ignore[arg-type]
        scope["app"] = self.app
        guard = self.app._guard
        assert guard is not None
        headers: list[tuple[bytes, bytes]] = scope["headers"]

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


async def answer(
    cycle: RequestResponseCycle,
    transport: asyncio.Transport,
    response: Response,
    seen: Seen | None = None,
) -> None:
    """A whole answer in one write; a relayed stream straight to the socket; anything else
    (another streaming response) through uvicorn's ``send``."""
    if isinstance(response, RelayResponse) and cycle.disconnected:
        # The client left before its stream began: only the clean-up is left to run.
        await response.on_close()
        return
    if cycle.disconnected:
        # uvicorn's send drops what a gone client would have got.
        await response(cycle.scope, cycle.receive, cycle.send)  # type: ignore[arg-type]
        return
    if seen is not None:
        seen.status = response.status_code
        seen.fields = fields_of(response.raw_headers)
    if isinstance(response, RelayResponse):
        await relay(cycle, transport, response)
        return
    if isinstance(response, StreamingResponse):
        await response(cycle.scope, cycle.receive, cycle.send)  # type: ignore[arg-type]
        return
    transport.write(head_of(cycle, response) + response.body)
    _complete(cycle)
    if response.background is not None:
        await response.background()


async def relay(
    cycle: RequestResponseCycle, transport: asyncio.Transport, response: RelayResponse
) -> None:
    """A stream in chunked encoding, written as uvicorn's ``send`` would write it.

    What is written within one turn of the loop leaves in one write at the turn's end: the
    head with the first chunk, and usually the last chunk with the end of the stream (a
    loopback send is the most expensive call of a relay). Before each chunk the flow
    control is honoured (a client that stops reading pauses the relay, as uvicorn's
    ``send`` does); a gone client stops it (``ClientWatch`` inside ``relay_to`` cancels it).
    """
    flow = cycle.flow
    try:
        pending = [head_of(cycle, response, chunked=True)]
    except BaseException:
        # A head that cannot be written: the stream's clean-up still runs, once.
        await response.on_close()
        raise
    scheduled = False
    loop = asyncio.get_running_loop()

    def flush() -> None:
        nonlocal scheduled
        scheduled = False
        if pending:
            if not transport.is_closing():
                transport.write(b"".join(pending))
            pending.clear()

    async def write(chunk: bytes) -> None:
        nonlocal scheduled
        if flow.write_paused and not cycle.disconnected:
            flush()
            await flow.drain()
        if cycle.disconnected:
            return
        pending.append(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        if not scheduled:
            scheduled = True
            loop.call_soon(flush)

    ended = await response.relay_to(cycle.receive, write)  # type: ignore[arg-type]
    if ended and not cycle.disconnected:
        pending.append(b"0\r\n\r\n")
        flush()
        _complete(cycle)
    else:
        # Cut (its deadline) or left: what was relayed still goes out before the close.
        flush()


def _complete(cycle: RequestResponseCycle) -> None:
    """The response's last byte is written: what uvicorn's ``send`` does at that point."""
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        # The protocol's own close (proxy.api.server): lingers while a body still arrives.
        cycle.transport.close()
    cycle.on_response()


def close_if_body_unread(cycle: RequestResponseCycle) -> None:
    """Mark the cycle's response as the connection's last when its request's body has not
    all arrived: its head then says ``connection: close`` (uvicorn adds it when
    ``keep_alive`` is off)."""
    if cycle.more_body:
        cycle.keep_alive = False


def head_of(cycle: RequestResponseCycle, response: Response, chunked: bool = False) -> bytes:
    """Status line and headers, as uvicorn's ``send`` writes them (its header checks too)."""
    close_if_body_unread(cycle)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    parts = [STATUS_LINE[response.status_code]]
    closing = False
    for name, value in cycle.default_headers + response.raw_headers:
        if HEADER_RE.search(name):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(value):
            raise RuntimeError("Invalid HTTP header value.")
        name = name.lower()
        if name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
            cycle.keep_alive = False
            closing = True
        parts += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive and not closing:
        parts.append(b"connection: close\r\n")
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
