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
  that never reads the body): the connection closes, so the rest of an unread body cannot
  hold it open a byte at a time.

The body's time and rate are the guard's business (``proxy.api.limits``).

A ``POST`` to an inference route skips the ASGI cycle: the protocol hands it to the lean
path (``proxy.api.lean``: the same guard and handler, the answer written straight to the
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

from proxy.api.lean import LeanPath, find_app, missing_cycle_parts
from proxy.config import Config, LimitsConfig
from proxy.errors import ApiError

log = logging.getLogger("kvroute.app")


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


class HeldHead:
    """A transport that holds a response's first write (its head) for the next one (its body)."""

    __slots__ = ("_held", "_loop", "_seen", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._seen = False

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
        self._transport.close()

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
    # The inference routes past the ASGI cycle (proxy.api.lean; switchable for the A/B).
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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
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
        if self.coalesce and cycle is not None and cycle.transport is self.transport:
            cycle.transport = HeldHead(self.transport, self.loop)  # type: ignore[assignment]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        lean = self._lean_path(app, cycle)
        handler = lean.handler(cycle.scope) if lean is not None else None  # type: ignore[arg-type]
        if lean is None or handler is None:
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
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            self.transport.close()
        super().on_response_complete()

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
