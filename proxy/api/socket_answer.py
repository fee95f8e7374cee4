"""An answer written straight to the socket, for the lean path (``proxy.api.entry``).

A whole answer (any non-streaming response) leaves in one ``transport.write``, head and
body together; a relayed stream is written chunk by chunk (``relay``: chunked encoding, the
head with the first chunk, uvicorn's flow control before each write so a client that stops
reading pauses the relay), under the same deadline and the same ``ClientWatch`` on the
cycle's ``receive`` (``RelayResponse.relay_to``), so a client that leaves still ends the
stream, its upstream connection and its reservation. The head is the one uvicorn's ``send``
would write, its header checks included.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from proxy.api.access_log import fields_of
from proxy.gateway.relay import RelayResponse

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class Seen:
    """What the access log's line needs of one request (status 0: no answer started)."""

    __slots__ = ("fields", "head", "status")

    def __init__(self) -> None:
        self.status = 0
        self.head = b""
        self.fields: dict[str, str] = {}


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
    headers = cycle.default_headers + response.raw_headers
    # uvicorn's two checks, each a one-character class: a search of all the names (values)
    # joined finds what a search of each finds, in one call instead of one per header.
    if HEADER_RE.search(b"".join([name for name, _ in headers])):
        raise RuntimeError("Invalid HTTP header name.")
    if HEADER_VALUE_RE.search(b"".join([value for _, value in headers])):
        raise RuntimeError("Invalid HTTP header value.")
    for name, value in headers:
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
