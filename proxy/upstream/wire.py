"""One HTTP/1.1 connection to a backend: an asyncio Protocol with httptools' response parser.

The lean upstream client (``proxy.upstream.lean_client``) sends the gateway's POSTs over these.
Profiled, aiohttp's client was ~31% of the gateway's samples for a tiny request (request
object, headers, writer, connector, parser); this does the one thing the hot path needs:
write a request in one ``transport.write`` and hand back status, headers and a body reader.

The answer's body is fed to a ``BodyReader`` with the same reading surface the gateway uses
on aiohttp's ``StreamReader`` (``read_nowait``, ``at_eof``, ``readany``, ``iter_any``), so
``proxy.upstream.client``'s body helpers serve both clients. Reading pauses the socket when
more than ``HIGH_WATER`` bytes wait unread (a slow client must not make the gateway buffer
a fast backend's whole stream) and resumes once they are taken.

A connection is reused only when its last answer was read to its end and both sides allow
keep-alive; anything else (an error, a cancel, an answer left unread) closes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import BadAnswer, ConnectionLost

# Unread body bytes above which the socket stops being read (aiohttp's default is 64 KiB too).
HIGH_WATER = 64 * 1024


class BodyReader:
    """The answer's body as it arrives; a broken connection surfaces as an exception on read."""

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_size", "_waiter")

    def __init__(self, conn: WireConnection) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn = conn

    # -- fed by the connection
    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if not self._eof and self._exc is None:
            self._exc = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the reading surface (the subset of aiohttp's StreamReader the gateway uses)
    def read_nowait(self) -> bytes:
        """What has arrived (b"" if nothing yet); the connection's error once all is taken."""
        if not self._chunks:
            if self._exc is not None:
                raise self._exc
            return b""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        self._conn.resume()
        return data

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    async def readany(self) -> bytes:
        """The next data (b"" at the end of the body); waits when nothing has arrived."""
        while not self._chunks and not self._eof and self._exc is None:
            waiter = self._conn.loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        return self.read_nowait()

    async def readany_by(self, when: float) -> bytes:
        """``readany`` that raises TimeoutError at ``when`` (loop clock) if nothing came.

        One timer on the wait's own future: cheaper than an ``asyncio.timeout`` scope
        (a task-level cancel and uncancel), and a stream waits once per event.
        """
        if not self._chunks and not self._eof and self._exc is None:
            loop = self._conn.loop
            waiter = loop.create_future()
            self._waiter = waiter
            timer = loop.call_at(when, _time_out, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                timer.cancel()
        return self.read_nowait()

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class WireConnection(asyncio.Protocol):
    """One kept-alive connection; at most one request on it at a time (no pipelining)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[WireConnection], None],
        key: tuple[str, str, int],
    ) -> None:
        self.loop = loop
        # (scheme, host, port): the pool this connection returns to.
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Set by the pool while the connection waits for reuse (loop clock).
        self.idle_since = 0.0
        self._on_lost = on_lost
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._head: asyncio.Future[None] | None = None
        self._raw_headers: list[tuple[str, str]] = []
        self._interim = False
        self._until_close = False
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.body: BodyReader | None = None
        self.complete = False
        self.keep_alive = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._head is None and self.body is None:
            # Bytes nobody asked for (on an idle connection): it cannot be trusted again.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"invalid HTTP answer ({exc.__class__.__name__})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        body = self.body
        if body is not None and not self.complete and self._until_close:
            # An answer with neither Content-Length nor chunked encoding ends with the connection.
            self.complete = True
            body.feed_eof()
        else:
            self._fail(ConnectionLost("the backend closed the connection"))
        self._on_lost(self)

    def pause_writing(self) -> None:
        # Requests are small and written at once; transport buffering is enough.
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # A second answer to one request: the connection is out of step; the parser's
            # error closes it (the answer already read stays valid).
            raise BadAnswer("more than one answer to one request")
        self._raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.
            self._interim = True
            return
        self.status = status
        self.headers = CIMultiDictProxy(CIMultiDict(self._raw_headers))
        self.keep_alive = self._parser.should_keep_alive()
        self._until_close = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        self.body = BodyReader(self)
        head = self._head
        self._head = None
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.body is not None:
            self.body.feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        if self.body is not None:
            self.body.feed_eof()

    # -- used by the client
    def send(self, data: list[bytes]) -> asyncio.Future[None]:
        """Write one whole request (its parts in order, one write); the future resolves when
        the answer's headers are in."""
        assert self.transport is not None
        self.status = 0
        self.body = None
        self.complete = False
        self._head = head = self.loop.create_future()
        if len(data) == 1:
            self.transport.write(data[0])
        else:
            self.transport.writelines(data)
        return head

    def reusable(self) -> bool:
        """The last answer was read to its end and both sides keep the connection open."""
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and self.body is not None
            and self.body.at_eof()
        )

    def reset(self) -> None:
        """Forget the last answer before the connection goes back to the pool."""
        self.body = None
        self._head = None
        self.complete = False

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Drop the connection (an abort: a cancelled answer's backend sees the reset at once)."""
        if not self.closed:
            self.closed = True
            self._fail(ConnectionLost("the connection was closed"))
            if self.transport is not None:
                self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        head = self._head
        self._head = None
        if head is not None and not head.done():
            head.set_exception(exc)
        if self.body is not None and not self.complete:
            self.body.set_exception(exc)
