"""RelayResponse and OnceCallback (proxy/gateway/relay.py): cleanup runs exactly once, always."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect
from starlette.types import Message

from proxy.gateway.relay import OnceCallback, RelayResponse

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/",
    "headers": [],
    "asgi": {"spec_version": "2.4"},
}


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


async def test_once_callback_runs_once_whoever_calls_it() -> None:
    counter = Counter()
    once = OnceCallback(counter)
    await once()
    await once()
    assert counter.calls == 1 and once.done


async def test_a_stream_that_ends_closes_once() -> None:
    counter = Counter()
    on_close = OnceCallback(counter)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            await on_close()

    sent: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    await RelayResponse(body(), on_close, media_type="text/event-stream")(SCOPE, receive, send)
    assert b"".join(sent) == b"data: 1\n\ndata: 2\n\n"
    assert counter.calls == 1


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
async def test_a_client_gone_before_the_first_chunk_still_closes(spec_version: str) -> None:
    """The body generator never starts, so only the response itself can run the cleanup.

    ASGI 2.0: Starlette sees the disconnect and cancels the response while the headers are
    still on their way; 2.4: the send itself fails.
    """
    counter = Counter()
    on_close = OnceCallback(counter)
    started = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal started
        started = True
        yield b"data: 1\n\n"

    async def send(message: Message) -> None:
        if spec_version == "2.4":
            raise OSError("client went away")
        await asyncio.Event().wait()  # the client never reads

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    scope = {**SCOPE, "asgi": {"spec_version": spec_version}}
    response = RelayResponse(body(), on_close, media_type="text/event-stream")
    with contextlib.suppress(ClientDisconnect):
        await asyncio.wait_for(response(scope, receive, send), timeout=5.0)
    assert not started
    assert counter.calls == 1


async def test_a_client_gone_mid_stream_stops_the_relay_on_a_pre_2_4_server() -> None:
    """uvicorn says ASGI 2.3: its send() ignores a gone client, so only the watch stops the relay."""
    counter = Counter()
    on_close = OnceCallback(counter)
    left = asyncio.Event()
    ended = asyncio.Event()
    chunks = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal chunks
        try:
            while True:
                chunks += 1
                if chunks == 3:
                    left.set()
                yield b"data: x\n\n"
                await asyncio.sleep(0.005)
        finally:
            ended.set()

    async def send(message: Message) -> None:
        return None  # a gone client's writes vanish, as uvicorn's do

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {**SCOPE, "asgi": {"spec_version": "2.3"}}
    response = RelayResponse(body(), on_close, media_type="text/event-stream")
    await asyncio.wait_for(response(scope, receive, send), timeout=5.0)
    assert ended.is_set() and counter.calls == 1
    # Stopped soon after the disconnect (the watch starts within 50 ms), not read forever.
    assert chunks < 200
