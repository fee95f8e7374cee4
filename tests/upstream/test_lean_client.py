"""The connection handling behind the POST clients, against real servers on 127.0.0.1.

Parametrized over both clients where the behaviour is the client's contract (reuse, chunked
answers, the answer cap, cancellation, no redirects); the pool's own bookkeeping (slots,
backpressure, garbage) is the lean client's and tested on it alone, under uvloop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
import uvloop
from aiohttp import web

from proxy.config import UpstreamConfig
from proxy.errors import AnswerTooLarge, UpstreamBroken, UpstreamConnectError, UpstreamTimeout
from proxy.upstream.client import Upstream, next_chunk, read_body
from proxy.upstream.lean_client import JOIN_BELOW_BYTES
from proxy.upstream.wire import HIGH_WATER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Backend:
    """An aiohttp.web server that records each request's peer port and disconnects."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.disconnected = asyncio.Event()
        self.arrived = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, handler: Handler, keepalive_timeout: float = 75.0) -> str:
        async def record(request: web.Request) -> web.StreamResponse:
            assert request.transport is not None
            self.peers.append(request.transport.get_extra_info("peername")[1])
            self.arrived.set()
            try:
                return await handler(request)
            except (asyncio.CancelledError, ConnectionResetError):
                self.disconnected.set()
                raise

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        self.runner = web.AppRunner(
            app,
            shutdown_timeout=0.1,
            keepalive_timeout=keepalive_timeout,
            handler_cancellation=True,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    b = Backend()
    yield b
    if b.runner is not None:
        await b.runner.cleanup()


def make(client: str, **kw: float | int) -> Upstream:
    settings: dict[str, object] = {"connect_timeout_s": 2.0, "ttfb_timeout_s": 5.0, **kw}
    return Upstream(UpstreamConfig(client=client, **settings))  # type: ignore[arg-type]


@pytest.fixture(params=["lean", "aiohttp"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    up = make(request.param)
    await up.start()
    yield up
    await up.close()


@pytest.fixture
async def lean_up() -> AsyncIterator[Upstream]:
    up = make("lean", max_connections=1)
    await up.start()
    yield up
    await up.close()


def far() -> float:
    return asyncio.get_running_loop().time() + 30.0


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"n": len(await request.read())})


async def test_a_fully_read_answer_returns_its_connection_for_reuse(
    backend: Backend, upstream: Upstream
) -> None:
    url = await backend.start(ok)
    for _ in range(3):
        resp = await upstream.post(url + "/v1/x", b"abc", {"content-type": "application/json"})
        assert await read_body(resp, 5.0, far(), 1 << 20) == b'{"n": 3}'
        resp.release()
    assert len(set(backend.peers)) == 1, backend.peers


async def test_bodies_of_every_size_arrive_whole_and_the_connection_is_reused(
    backend: Backend, upstream: Upstream
) -> None:
    """A long body goes out beside its head (``JOIN_BELOW_BYTES``), a short one behind it."""

    async def digest(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"sha": hashlib.sha256(body).hexdigest()})

    url = await backend.start(digest)
    for size in (0, 1, JOIN_BELOW_BYTES - 1, JOIN_BELOW_BYTES, 220_000, 1_000_000):
        body = bytes(random.Random(size).getrandbits(8) for _ in range(min(size, 4096)))
        body = (body * (size // 4096 + 1))[:size]
        resp = await upstream.post(url + "/v1/x", body, {"content-type": "application/json"})
        answer = await read_body(resp, 5.0, far(), 1 << 20)
        assert orjson.loads(answer) == {"sha": hashlib.sha256(body).hexdigest()}, size
        resp.release()
    assert len(set(backend.peers)) == 1, backend.peers


async def test_a_chunked_answer_is_read_to_its_end(backend: Backend, upstream: Upstream) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    url = await backend.start(chunked)
    resp = await upstream.post(url, b"", {})
    got = b""
    while chunk := await next_chunk(resp, 5.0, far()):
        got += chunk
    assert got == b"".join(f"data: {i}\n\n".encode() for i in range(5))
    resp.release()
    # Reused: the chunked answer ended cleanly.
    resp = await upstream.post(url, b"", {})
    await read_body(resp, 5.0, far(), 1 << 20)
    resp.release()
    assert len(set(backend.peers)) == 1


async def test_an_answer_above_the_cap_is_refused(backend: Backend, upstream: Upstream) -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 200_000)

    url = await backend.start(big)
    resp = await upstream.post(url, b"", {})
    with pytest.raises(AnswerTooLarge):
        await read_body(resp, 5.0, far(), 100_000)
    resp.close()


async def test_a_redirect_is_returned_not_followed(backend: Backend, upstream: Upstream) -> None:
    async def moved(request: web.Request) -> web.Response:
        if request.path == "/elsewhere":
            return web.Response(text="followed")
        raise web.HTTPFound("/elsewhere")

    url = await backend.start(moved)
    resp = await upstream.post(url + "/v1/x", b"prompt", {})
    assert resp.status == 302
    resp.close()
    assert len(backend.peers) == 1


async def test_closing_mid_answer_drops_the_connection_and_the_backend_sees_it(
    backend: Backend, upstream: Upstream
) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if request.path == "/short":
            await resp.write(b"data: 1\n\n")
            await resp.write_eof()
            return resp
        while True:
            await resp.write(b"data: x\n\n")
            await asyncio.sleep(0.01)

    url = await backend.start(endless)
    resp = await upstream.post(url, b"", {})
    assert await next_chunk(resp, 5.0, far())
    resp.close()
    await asyncio.wait_for(backend.disconnected.wait(), 5.0)
    resp = await upstream.post(url + "/short", b"", {})
    await read_body(resp, 5.0, far(), 1 << 20)
    resp.release()
    assert len(set(backend.peers)) == 2, "a connection closed mid-answer was reused"


async def test_cancelling_the_wait_for_headers_drops_the_connection(
    backend: Backend, upstream: Upstream
) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.Response()

    url = await backend.start(slow)
    task = asyncio.create_task(upstream.post(url, b"", {}))
    await asyncio.wait_for(backend.arrived.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(backend.disconnected.wait(), 5.0)
    if upstream.pool is not None:
        assert upstream.pool.in_use == 0
        assert not any(upstream.pool.idle.values())


async def test_a_released_answer_that_was_not_read_to_its_end_is_not_reused(
    backend: Backend, lean_up: Upstream
) -> None:
    async def two_parts(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 20
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        await asyncio.sleep(0.2)
        await resp.write(b"y" * 10)
        return resp

    url = await backend.start(two_parts)
    resp = await lean_up.post(url, b"", {})
    assert await next_chunk(resp, 5.0, far()) == b"x" * 10
    resp.release()
    assert lean_up.pool is not None
    assert lean_up.pool.in_use == 0 and not any(lean_up.pool.idle.values())


async def test_the_pool_bound_makes_a_second_request_wait_then_time_out(
    backend: Backend,
) -> None:
    up = make("lean", max_connections=1, connect_timeout_s=0.2)
    await up.start()
    try:
        url = await backend.start(ok)
        first = await up.post(url, b"", {})
        with pytest.raises(UpstreamTimeout) as err:
            await up.post(url, b"", {})
        assert err.value.phase == "connect"
        waiting = asyncio.create_task(up.post(url, b"ab", {}))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await read_body(first, 5.0, far(), 1 << 20)
        first.release()
        second = await waiting
        assert await read_body(second, 5.0, far(), 1 << 20) == b'{"n": 2}'
        second.release()
    finally:
        await up.close()


async def test_an_idle_connection_the_backend_closed_is_not_used(backend: Backend) -> None:
    up = make("lean")
    await up.start()
    try:
        url = await backend.start(ok, keepalive_timeout=0.05)
        resp = await up.post(url, b"", {})
        await read_body(resp, 5.0, far(), 1 << 20)
        resp.release()
        await asyncio.sleep(0.3)
        resp = await up.post(url, b"", {})
        assert resp.status == 200
        await read_body(resp, 5.0, far(), 1 << 20)
        resp.release()
        assert len(set(backend.peers)) == 2
    finally:
        await up.close()


async def raw_reply_server(reply: bytes) -> tuple[asyncio.Server, int]:
    """A TCP server that answers any request with ``reply`` as is, then waits for the close."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(100)
        w.write(reply)
        with contextlib.suppress(ConnectionError):
            await r.read(100)
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port: int = srv.sockets[0].getsockname()[1]
    return srv, port


async def test_garbage_before_the_head_is_broken_and_the_connection_dropped() -> None:
    srv, port = await raw_reply_server(b"NOT HTTP AT ALL\r\n\r\n")
    up = make("lean")
    await up.start()
    try:
        with pytest.raises(UpstreamBroken) as err:
            await up.post(f"http://127.0.0.1:{port}/", b"", {})
        assert "not an HTTP answer" in str(err.value)
        assert up.pool is not None and up.pool.in_use == 0
    finally:
        await up.close()
        srv.close()


async def test_a_header_with_a_line_break_is_refused_before_sending(backend: Backend) -> None:
    up = make("lean")
    await up.start()
    try:
        url = await backend.start(ok)
        with pytest.raises(UpstreamConnectError):
            await up.post(url, b"", {"authorization": "Bearer k\r\nX-Injected: 1"})
        assert backend.peers == []
    finally:
        await up.close()


async def test_an_unread_stream_pauses_the_socket(backend: Backend) -> None:
    async def firehose(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2000):
            await resp.write(b"x" * 4096)
        return resp

    up = make("lean")
    await up.start()
    try:
        url = await backend.start(firehose)
        resp = await up.post(url, b"", {})
        await asyncio.sleep(0.5)
        reader = resp.content
        buffered = len(reader.read_nowait())
        # 8 MB were offered; the gateway held only about one high-water mark of it.
        assert 0 < buffered < 4 * HIGH_WATER, buffered
        got = buffered
        while chunk := await next_chunk(resp, 5.0, far()):
            got += len(chunk)
        assert got == 2000 * 4096
        resp.release()
    finally:
        await up.close()


def test_the_lean_client_under_uvloop() -> None:
    """The gateway runs on uvloop, whose transports are not asyncio's classes."""

    async def main() -> bytes:
        b = Backend()
        url = await b.start(ok)
        up = make("lean")
        await up.start()
        try:
            out = b""
            for _ in range(2):
                resp = await up.post(url, b"abcd", {})
                out = await read_body(resp, 5.0, far(), 1 << 20)
                resp.release()
            assert len(set(b.peers)) == 1
            return out
        finally:
            await up.close()
            assert b.runner is not None
            await b.runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == b'{"n": 4}'


async def test_an_answer_dropped_without_close_frees_its_slot(backend: Backend) -> None:
    up = make("lean", max_connections=1)
    await up.start()
    try:
        url = await backend.start(ok)
        resp = await up.post(url, b"", {})
        assert up.pool is not None and up.pool.in_use == 1
        del resp
        assert up.pool.in_use == 0
        resp = await up.post(url, b"", {})
        assert resp.status == 200
        resp.close()
    finally:
        await up.close()


async def test_bytes_after_a_complete_answer_keep_the_connection_from_reuse() -> None:
    srv, port = await raw_reply_server(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    )
    up = make("lean")
    await up.start()
    try:
        resp = await up.post(f"http://127.0.0.1:{port}/", b"", {})
        assert await read_body(resp, 5.0, far(), 1 << 20) == b"ok"
        resp.release()
        assert up.pool is not None and not any(up.pool.idle.values())
    finally:
        await up.close()
        srv.close()


async def test_a_connection_idle_past_the_keepalive_is_not_reused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.upstream import lean_client as lean

    monkeypatch.setattr(lean, "KEEPALIVE_S", 0.05)
    up = make("lean")
    await up.start()
    try:
        url = await backend.start(ok)
        for pause in (0.0, 0.3):
            await asyncio.sleep(pause)
            resp = await up.post(url, b"", {})
            await read_body(resp, 5.0, far(), 1 << 20)
            resp.release()
        # The backend (75 s keep-alive) kept it open: the client itself chose a new one.
        assert len(set(backend.peers)) == 2
    finally:
        await up.close()
