"""``proxy.api.socket_answer.answer``: what reaches the socket, on a real uvicorn cycle.

The transport is a recorder (pure logic: what is written, in how many writes, closed or
not); the cycle, its flow control and the responses are the real ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from starlette.responses import Response
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.api.entry import CYCLE_PARTS, missing_cycle_parts
from proxy.api.socket_answer import answer, head_of
from proxy.gateway.relay import OnceCallback, RelayResponse


class Recorder:
    """A transport that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def cycle_on(
    wire: Recorder, keep_alive: bool = True, body_read: bool = True
) -> RequestResponseCycle:
    """A cycle writing to ``wire``; ``body_read``: its request's body has all arrived."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    cycle = RequestResponseCycle(
        scope=scope,  # type: ignore[arg-type]
        transport=wire,  # type: ignore[arg-type]
        flow=FlowControl(wire),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    cycle.more_body = not body_read
    return cycle


class Closes:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


async def events(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


def relay_of(
    closes: Closes, *chunks: bytes, headers: dict[str, str] | None = None
) -> RelayResponse:
    return RelayResponse(
        events(*chunks), OnceCallback(closes), headers=headers, media_type="text/event-stream"
    )


def unchunk(raw: bytes) -> bytes:
    out = b""
    while True:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert raw == b"\r\n"
            return out
        out, raw = out + raw[:n], raw[n + 2 :]


async def test_a_whole_answer_leaves_in_one_write() -> None:
    wire = Recorder()
    cycle = cycle_on(wire)
    await answer(cycle, wire, Response(b'{"ok":1}', media_type="application/json"))  # type: ignore[arg-type]
    (only,) = wire.writes
    head, _, body = only.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 8" in head
    assert body == b'{"ok":1}' and cycle.response_complete and not wire.closed


async def test_a_closing_connection_says_so_and_closes() -> None:
    wire = Recorder()
    cycle = cycle_on(wire, keep_alive=False)
    await answer(cycle, wire, Response(b"{}"))  # type: ignore[arg-type]
    assert b"connection: close\r\n" in wire.writes[0] and wire.closed


async def test_an_answer_before_the_body_ends_is_the_connections_last() -> None:
    wire = Recorder()
    cycle = cycle_on(wire, body_read=False)
    await answer(cycle, wire, Response(b"{}", status_code=413))  # type: ignore[arg-type]
    assert b"connection: close\r\n" in wire.writes[0] and wire.closed


async def test_a_stream_is_chunked_with_its_head_in_the_first_write() -> None:
    wire = Recorder()
    cycle = cycle_on(wire)
    closes = Closes()
    await answer(cycle, wire, relay_of(closes, b"data: 1\n\n", b"", b"data: [DONE]\n\n"))  # type: ignore[arg-type]
    raw = b"".join(wire.writes)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and b"content-length" not in head
    assert unchunk(body) == b"data: 1\n\ndata: [DONE]\n\n"
    # Written within one turn of the loop: one write, the end of the stream included.
    assert len(wire.writes) == 1
    assert closes.calls == 1 and cycle.response_complete


async def test_a_client_gone_before_its_stream_began_still_gets_the_clean_up() -> None:
    wire = Recorder()
    cycle = cycle_on(wire)
    cycle.disconnected = True
    closes = Closes()
    await answer(cycle, wire, relay_of(closes, b"data: 1\n\n"))  # type: ignore[arg-type]
    assert closes.calls == 1 and wire.writes == []


async def test_a_head_that_cannot_be_written_still_runs_the_clean_up() -> None:
    wire = Recorder()
    closes = Closes()
    bad = relay_of(closes, b"data: 1\n\n", headers={"x-bad": "a\x01b"})
    with pytest.raises(RuntimeError):
        await answer(cycle_on(wire), wire, bad)  # type: ignore[arg-type]
    assert closes.calls == 1 and wire.writes == []


@pytest.mark.parametrize(
    ("name", "value", "refused"),
    [
        (b"x-ok", b"plain value\twith tab", None),
        (b"x bad", b"v", "name"),
        (b"x-bad:", b"v", "name"),
        (b"x-ok", b"a\r\nset-cookie: s=1", "value"),
        (b"x-ok", b"a\x7fb", "value"),
    ],
)
def test_the_head_refuses_what_uvicorn_refuses(
    name: bytes, value: bytes, refused: str | None
) -> None:
    """The names (values) are checked joined, once: the verdict is each header's own."""
    response = Response(b"{}")
    # After good headers, so a check of only the first one would miss it.
    response.raw_headers = [*response.raw_headers, (b"x-before", b"fine"), (name, value)]
    cycle = cycle_on(Recorder())
    if refused is None:
        assert name + b": " + value + b"\r\n" in head_of(cycle, response)
        return
    with pytest.raises(RuntimeError, match=f"Invalid HTTP header {refused}"):
        head_of(cycle, response)


async def test_this_uvicorn_has_every_part_of_the_cycle_the_lean_path_drives() -> None:
    """The canary for a uvicorn upgrade: a missing part turns the lean path off (logged)."""
    assert missing_cycle_parts(cycle_on(Recorder())) == []
    assert missing_cycle_parts(object()) == list(CYCLE_PARTS)
