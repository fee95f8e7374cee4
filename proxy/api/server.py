"""The HTTP server's own guard: a request's header block is bounded in size and in time.

uvicorn's httptools protocol buffers a header block without limit and never times out a
connection that is still sending one (measured: 4 connections sending 20 MB of an unfinished
header took the gateway from 126 to 221 MB; 500 connections trickling a header were never
cut). The ASGI app sees a request only once its headers are complete, too late to help, so
the bound lives here, in a subclass of uvicorn's protocol:

* more than ``limits.max_header_bytes`` before the headers end: 431 and the connection closes;
* headers not complete ``limits.header_timeout_s`` after the connection opened (or after
  the request's first byte, on a kept-alive connection): the connection closes;
* a response sent before its request's body was read to the end (a refusal, or a route
  that never reads the body) says ``connection: close`` in its head, so the client does not
  send its next request down a connection about to close (CI once met the reset that
  followed); the connection then lingers: the answer goes out with a FIN, and what is
  still arriving of the body is read and dropped for at most ``LINGER_S`` seconds and
  ``LINGER_BYTES`` bytes before the socket closes. Closing at once, with body bytes
  unread, makes the kernel send a reset, which can destroy the answer before the client
  reads it: a client sending a body over the limit saw "connection reset" instead of its
  413. The rest of an unread body cannot hold the connection open beyond those bounds.

The body's time and rate are the guard's business (``proxy.api.limits``).

A ``POST`` to an inference route skips the ASGI cycle: the protocol hands it to the lean
path (``proxy.api.entry``: the same guard and handler, the answer written straight to the
socket). ``KVROUTE_LEAN=0`` sends it through the ASGI stack like every other request.

The protocol also holds each response's head (status line and headers) until its body's
first write, so a small answer leaves in one ``send`` instead of two: uvicorn writes them
separately, and a loopback send is the most expensive call on the hot path (docs/benchmarks.md,
Issue 12). A head whose body does not follow at once is sent on the loop's next turn.
"""

from __future__ import annotations

import asyncio
import logging
import os
from asyncio import TimerHandle
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.api.entry import LeanPath, missing_cycle_parts
from proxy.api.gateway_app import find_app
from proxy.api.socket_answer import close_if_body_unread
from proxy.config import Config, LimitsConfig
from proxy.errors import ApiError

log = logging.getLogger("kvroute.app")

#: How long, and how many bytes, a connection answered before its request's body ended
#: reads and drops the rest of that body before it closes (nginx's "lingering close").
LINGER_S = 2.0
LINGER_BYTES = 64 * 1024 * 1024


def _closing_send(cycle: RequestResponseCycle) -> Any:
    """The cycle's ``send``, marking the response as the connection's last when its
    request's body has not all arrived by the time the head goes out."""
    send = cycle.send

    async def closing_send(message: Any) -> None:
        if message["type"] == "http.response.start":
            close_if_body_unread(cycle)
        await send(message)

    return closing_send


def _header_refusal(limit: int) -> bytes:
    body = (
        ApiError(
            431,
            f"request headers are larger than {limit} bytes",
            code="request_header_fields_too_large",
        )
        .response()
        .body
    )
    head = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + bytes(body)


class AnswerTransport:
    """A request's view of its connection: holds a response's first write (its head) for
    the next one (its body), and closes the connection the way the protocol says.

    Closing after an answer goes through ``GuardedProtocol.close_answered``, which lingers
    when the request's body has not all arrived (see the module's docstring).
    """

    __slots__ = ("_held", "_loop", "_protocol", "_seen", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        protocol: GuardedProtocol,
        hold: bool,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._protocol = protocol
        self._held: bytes | None = None
        # ``hold`` off: every write goes out as it comes (the benchmark's A/B of coalescing).
        self._seen = not hold

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif not self._seen:
            self._seen = True
            self._held = data
            # The body usually follows within this turn; if not, the head still goes out.
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._protocol.close_answered()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """httptools with a header-size and header-time bound (class attributes set per config)."""

    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 10.0
    refused_headers: int = 0
    timed_out_headers: int = 0
    # Head and body of a response in one write (switchable for the benchmark's A/B).
    coalesce: bool = True
    # The inference routes past the ASGI cycle (proxy.api.entry; switchable for the A/B).
    lean: bool = True
    # Found from uvicorn's loaded app on the first request: None when no GatewayApp is
    # reachable through proxy-header layers only.
    _lean_app: Any = None
    _lean_path_found: LeanPath | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True
        self._header_bytes = 0
        self._header_timer: TimerHandle | None = None
        # Bytes still allowed to arrive (and be dropped) while the connection lingers.
        self._linger_left: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if not self._in_headers or self.transport.is_closing():
            return
        if self._header_bytes > self.max_header_bytes:
            type(self).refused_headers += 1
            self._disarm_header_timer()
            self.transport.write(_header_refusal(self.max_header_bytes))
            self.transport.close()
        else:
            # Headers still incomplete after these bytes: their time runs from now (a request
            # whose headers came whole in one read never needs a timer).
            self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:
            answer = AnswerTransport(self.transport, self.loop, self, self.coalesce)
            cycle.transport = answer  # type: ignore[assignment]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        lean = self._lean_path(app, cycle)
        handler = lean.handler(cycle.scope) if lean is not None else None  # type: ignore[arg-type]
        if lean is None or handler is None:
            cycle.send = _closing_send(cycle)  # type: ignore[method-assign]
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(lean.run(cycle, self.transport, handler))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _lean_path(self, app: Any, cycle: RequestResponseCycle) -> LeanPath | None:
        # Not for uvicorn's own 503 app (its limit_concurrency), nor with the lean path off.
        if not self.lean or app is not self.app:
            return None
        cls = type(self)
        if cls._lean_app is not app:
            found = find_app(app)
            missing = missing_cycle_parts(cycle)
            if missing:
                # The lean path drives uvicorn's cycle by its internals; a uvicorn without
                # them gets the ASGI stack for every request (correct, a little slower).
                log.warning(
                    "uvicorn %s lacks %s: inference requests take the ASGI stack",
                    uvicorn.__version__,
                    ", ".join(missing),
                )
                found = None
            cls._lean_path_found = LeanPath(*found) if found is not None else None
            cls._lean_app = app
        return cls._lean_path_found

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body:
            self._linger()
        super().on_response_complete()

    def close_answered(self) -> None:
        """Close the connection after an answer: at once, or lingering while the request's
        body is still arriving."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body:
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Send the answer with a FIN, drop what still arrives of the body, close later."""
        transport = self.transport
        if self._linger_left is not None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._linger_left = LINGER_BYTES
        self.loop.call_later(LINGER_S, transport.close)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            type(self).timed_out_headers += 1
            self.transport.close()


def guarded_protocol(limits: LimitsConfig) -> type[GuardedProtocol]:
    """A protocol class carrying this config's limits (uvicorn builds one per connection)."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol,),
        {
            "max_header_bytes": limits.max_header_bytes,
            "header_timeout_s": limits.header_timeout_s,
            # Off only for the overhead benchmark's A/B (python -m loadtest.bench.overhead --coalesce-ab).
            "coalesce": os.environ.get("KVROUTE_COALESCE_WRITES", "1") != "0",
            "lean": os.environ.get("KVROUTE_LEAN", "1") != "0",
        },
    )


def server_config(app: Any, cfg: Config, host: str, port: int, **kw: Any) -> uvicorn.Config:
    """The uvicorn settings every kvroute server runs with (``kvroute serve`` and the tests)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(cfg.limits),
        access_log=False,
        timeout_keep_alive=30,
        **kw,
    )
