"""The upstream clients (proxy/upstream/client.py, lean.py) against real aiohttp servers on 127.0.0.1.

What the gateway relies on: library errors never escape as themselves (a broken connection
is ``UpstreamBroken``, a refused one ``UpstreamConnectError``), each timeout names its phase,
and headers are filtered the way RFC 9110 asks of a proxy.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import UpstreamConfig
from proxy.errors import (
    BodyTimeout,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamTimeout,
    WireError,
)
from proxy.upstream.client import (
    Upstream,
    forward_headers,
    next_chunk,
    read_body,
    read_limited,
    response_headers,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start an aiohttp server for one handler; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(params=["lean", "aiohttp"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    """Both POST clients: each test holds for the lean one and for aiohttp's."""
    up = Upstream(UpstreamConfig(connect_timeout_s=2.0, ttfb_timeout_s=5.0, client=request.param))
    await up.start()
    yield up
    await up.close()


def far_deadline() -> float:
    return asyncio.get_running_loop().time() + 30.0


async def test_post_relays_the_body_and_reads_the_answer(serve: Serve, upstream: Upstream) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"got": (await request.read()).decode(), "auth": request.headers.get("authorization")}
        )

    url = await serve(echo)
    resp = await upstream.post(url + "/v1/x", b"hello", {"authorization": "Bearer k"})
    assert resp.status == 200
    body = await read_body(resp, 5.0, far_deadline(), 1 << 20)
    assert body == b'{"got": "hello", "auth": "Bearer k"}'


async def test_a_refused_connection_is_a_connect_error(upstream: Upstream) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port now.
    with pytest.raises(UpstreamConnectError) as err:
        await upstream.post(f"http://127.0.0.1:{port}/", b"", {})
    assert err.value.failure == "connect_error"


async def test_no_headers_in_time_is_a_ttfb_timeout(serve: Serve, upstream: Upstream) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.Response()

    url = await serve(slow)
    with pytest.raises(UpstreamTimeout) as err:
        await upstream.post(url, b"", {}, ttfb_s=0.1)
    assert err.value.phase == "ttfb" and err.value.failure == "ttfb_timeout"


async def stalled_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: 1\n\n")
    await asyncio.sleep(10)
    return resp


async def test_a_gap_between_chunks_is_an_idle_timeout(serve: Serve, upstream: Upstream) -> None:
    url = await serve(stalled_stream)
    resp = await upstream.post(url, b"", {})
    assert await next_chunk(resp, 5.0, far_deadline()) == b"data: 1\n\n"
    with pytest.raises(BodyTimeout) as err:
        await next_chunk(resp, 0.1, far_deadline())
    assert err.value.phase == "idle" and err.value.failure == "idle_timeout"
    resp.close()


async def test_the_total_deadline_wins_over_a_longer_idle_gap(
    serve: Serve, upstream: Upstream
) -> None:
    url = await serve(stalled_stream)
    resp = await upstream.post(url, b"", {})
    await next_chunk(resp, 5.0, far_deadline())
    deadline = asyncio.get_running_loop().time() + 0.1
    with pytest.raises(BodyTimeout) as err:
        await next_chunk(resp, 30.0, deadline)
    assert err.value.phase == "total"
    with pytest.raises(BodyTimeout):
        await next_chunk(resp, 30.0, deadline)  # past it: at once
    resp.close()


async def test_a_body_that_breaks_off_is_upstream_broken_not_aiohttps_error(
    serve: Serve, upstream: Upstream
) -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"partial": ')
        assert request.transport is not None
        request.transport.close()
        return resp

    url = await serve(breaks)
    resp = await upstream.post(url, b"", {})
    with pytest.raises(UpstreamBroken) as err:
        await read_body(resp, 5.0, far_deadline(), 1 << 20)
    assert not isinstance(err.value, aiohttp.ClientError)
    assert err.value.failure == "broken"
    assert isinstance(err.value.__cause__, aiohttp.ClientError | WireError)
    assert err.value.cause == type(err.value.__cause__).__name__


async def test_read_limited_stops_at_its_limit(serve: Serve, upstream: Upstream) -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 100_000, status=500)

    url = await serve(big)
    resp = await upstream.post(url, b"", {})
    assert await read_limited(resp, limit=1000) == b"x" * 1000
    resp.close()


async def test_get_reads_status_and_body(serve: Serve, upstream: Upstream) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok", status=204 if request.path == "/none" else 200)

    url = await serve(health)
    assert await upstream.get(url + "/health", 5.0) == (200, b"ok")


def test_forward_headers_drop_hop_by_hop_and_connection_listed() -> None:
    # Case-insensitive, as Starlette's request headers are.
    headers = CIMultiDict(
        {
            "Authorization": "Bearer k",
            "Connection": "keep-alive, X-Secret",
            "X-Secret": "1",
            "Keep-Alive": "timeout=5",
            "Host": "gateway",
            "Content-Length": "12",
            "Transfer-Encoding": "chunked",
            "X-Request-Id": "r1",
        }
    )
    assert forward_headers(headers, False) == {"Authorization": "Bearer k", "X-Request-Id": "r1"}
    assert forward_headers(headers, True) == {"X-Request-Id": "r1"}


def test_response_headers_drop_what_the_proxy_recomputes() -> None:
    # Case-insensitive, as aiohttp's response headers are.
    headers = CIMultiDict(
        {
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
            "Date": "x",
            "Server": "engine",
            "Retry-After": "2",
            "Connection": "close",
        }
    )
    assert response_headers(headers) == {"Content-Type": "application/json", "Retry-After": "2"}


def test_body_read_errors_map_to_broken_but_timeouts_and_others_pass() -> None:
    from proxy.upstream.client import _map_broken

    with pytest.raises(UpstreamBroken) as broke:
        with _map_broken:
            raise ConnectionResetError("reset")
    assert isinstance(broke.value.__cause__, ConnectionResetError)
    assert "ConnectionResetError" in str(broke.value)
    # The lean reader's own timer: a timeout, though an OSError.
    with pytest.raises(TimeoutError), _map_broken:
        raise TimeoutError
    with pytest.raises(ValueError), _map_broken:
        raise ValueError("not the connection's")
    with _map_broken:
        pass
