"""The lean upstream client: the gateway's POST to a backend over a pool of kept-alive connections.

Chosen by ``upstream.client: lean`` (the default; ``aiohttp`` keeps the former client). It
raises exactly what ``proxy.upstream.client`` raises for aiohttp's errors, so the gateway
cannot tell the two apart except by cost (docs/benchmarks.md, Issue 12: wire cost):

* a refused or unreachable address: ``UpstreamConnectError``; no connection within
  ``connect_timeout_s`` (a free pool slot included, as aiohttp counts it): ``UpstreamTimeout``
  phase "connect"; no answer head within the TTFB limit: ``UpstreamTimeout`` phase "ttfb";
* connected, then closed before the head: ``UpstreamBroken`` ("closed the connection
  before answering"); bytes that are not HTTP: ``UpstreamBroken`` too (aiohttp's client
  calls those a ``ClientResponseError``, which became a connect error: a backend that
  answers garbage is reached, so it is not reported as unreachable); a header value that cannot go on the wire (CR, LF, not
  Latin-1): ``UpstreamConnectError`` ("request refused by the client library");
* body errors surface from the reader as ``WireError`` (``proxy.errors``), which the body
  helpers in ``proxy.upstream.client`` turn into ``UpstreamBroken`` as they do aiohttp's.

Redirects are never followed (the answer is returned as it is). The pool is bounded by
``upstream.max_connections`` connections in use across backends; idle ones are dropped
after ``KEEPALIVE_S`` (4 s) or when the backend closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from multidict import CIMultiDictProxy

from proxy.config import UpstreamConfig
from proxy.errors import (
    BadAnswer,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamTimeout,
    WireError,
)
from proxy.upstream.wire import WireConnection

# Idle connections older than this are not reused. Below the 5 s keep-alive of engines served
# by uvicorn (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default, SGLang's), so the gateway never
# sends on a connection the engine is closing at that moment (aiohttp's setting here was 30 s;
# the race turned a request into a "broken" attempt counted against the backend).
KEEPALIVE_S = 4.0

# Fields this client writes itself; a caller's copy is dropped rather than sent twice.
_OWN = frozenset({"host", "content-length", "transfer-encoding", "connection"})

Key = tuple[str, str, int]


class _Target:
    """A URL split once: which pool, what request target, which Host header."""

    __slots__ = ("head", "key", "path")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL")
        port = parts.port or (443 if scheme == "https" else 80)
        self.key: Key = (scheme, parts.hostname, port)
        path = parts.path or "/"
        self.path = path + ("?" + parts.query if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        self.head = f"POST {self.path} HTTP/1.1\r\nHost: {host}\r\n"


#: A body at least this long is handed to the socket beside the head, not copied behind it
#: (one ``writelines``: a 220 KB prompt's copy was 1.7% of the gateway's CPU on it).
JOIN_BELOW_BYTES = 16 * 1024


def request_bytes(target_head: str, headers: Mapping[str, str], body: bytes) -> list[bytes]:
    """The whole request, ready for one write: the head with the body behind it, or the head
    and a long body side by side; ValueError for a field that cannot be sent."""
    parts = [target_head]
    for name, value in headers.items():
        if name.lower() in _OWN:
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError("a header contains a line break")
        parts.append(f"{name}: {value}\r\n")
    parts.append(f"Content-Length: {len(body)}\r\n\r\n")
    head = "".join(parts).encode("latin-1")
    return [head, body] if len(body) >= JOIN_BELOW_BYTES else [head + body]


class LeanResponse:
    """An answer whose head arrived: status, headers, the body reader; then close or release."""

    __slots__ = ("_conn", "_done", "_pool", "content", "headers", "status")

    def __init__(self, conn: WireConnection, pool: Pool) -> None:
        assert conn.body is not None
        self.status: int = conn.status
        self.headers: CIMultiDictProxy[str] = conn.headers
        self.content = conn.body
        self._conn = conn
        self._pool = pool
        self._done = False

    def close(self) -> None:
        """Drop the connection (the backend sees the cancel) and free its pool slot."""
        if not self._done:
            self._done = True
            self._conn.close()
            self._pool.free_slot()

    def release(self) -> None:
        """Return the connection for reuse if its answer was read to the end, else drop it."""
        if not self._done:
            self._done = True
            self._pool.put_back(self._conn)

    def __del__(self) -> None:
        # An answer dropped without close() or release() must not keep its pool slot forever.
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._conn.close()
                self._pool.free_slot()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.content.iter_any()])

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self.content.iter_any()


class Pool:
    """Kept-alive connections per (scheme, host, port); at most ``limit`` in use at once."""

    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self.limit = cfg.max_connections
        self.in_use = 0
        self.idle: dict[Key, list[WireConnection]] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None

    def target(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            t = _Target(url)
            if len(self._targets) > 4096:
                self._targets.clear()
            self._targets[url] = t
        return t

    async def acquire(self, key: Key, deadline: float) -> WireConnection:
        """A connection to ``key``: an idle one if any, else a new one once a slot is free."""
        loop = asyncio.get_running_loop()
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.closed or loop.time() - conn.idle_since > KEEPALIVE_S:
                conn.close()
                continue
            self.in_use += 1
            return conn
        async with asyncio.timeout_at(deadline):
            while self.in_use >= self.limit:
                waiter = loop.create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
            self.in_use += 1
            try:
                scheme, host, port = key
                _, conn = await loop.create_connection(
                    lambda: WireConnection(loop, self._lost, key),
                    host,
                    port,
                    ssl=self._ssl_context() if scheme == "https" else None,
                )
            except BaseException:
                self.free_slot()
                raise
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def free_slot(self) -> None:
        self.in_use -= 1
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                break

    def put_back(self, conn: WireConnection) -> None:
        if conn.reusable():
            conn.reset()
            conn.idle_since = asyncio.get_running_loop().time()
            key = conn.key
            self.idle.setdefault(key, []).append(conn)
        else:
            conn.close()
        self.free_slot()

    def _lost(self, conn: WireConnection) -> None:
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()


async def post(
    pool: Pool, url: str, body: bytes, headers: Mapping[str, str], limit: float
) -> LeanResponse:
    """Send the request; return once the answer's head arrived (the body is still to read)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + limit
    connect_by = start + pool.cfg.connect_timeout_s
    try:
        target = pool.target(url)
        data = request_bytes(target.head, headers, body)
    except (ValueError, UnicodeError) as exc:
        raise UpstreamConnectError(
            f"request refused by the client library: {exc.__class__.__name__}"
        ) from None
    try:
        conn = await pool.acquire(target.key, min(connect_by, deadline))
    except TimeoutError:
        if connect_by <= deadline:
            raise UpstreamTimeout(
                f"could not connect within {pool.cfg.connect_timeout_s}s", "connect"
            ) from None
        raise UpstreamTimeout(f"no response within {limit:g}s", "ttfb") from None
    except OSError as exc:
        raise UpstreamConnectError(f"{exc.__class__.__name__}") from None
    head = conn.send(data)
    timer = loop.call_at(deadline, _expire, head)
    try:
        await head
    except TimeoutError:
        _drop(pool, conn)
        raise UpstreamTimeout(f"no response within {limit:g}s", "ttfb") from None
    except BadAnswer:
        _drop(pool, conn)
        raise UpstreamBroken(
            "answered with bytes that are not an HTTP answer (BadAnswer)"
        ) from None
    except (WireError, ConnectionError) as exc:
        _drop(pool, conn)
        raise UpstreamBroken(
            f"closed the connection before answering ({exc.__class__.__name__})"
        ) from None
    except BaseException:
        # Cancelled (the client left, or an outer deadline): the backend sees the connection go.
        _drop(pool, conn)
        raise
    finally:
        timer.cancel()
    return LeanResponse(conn, pool)


def _expire(head: asyncio.Future[None]) -> None:
    if not head.done():
        head.set_exception(TimeoutError())


def _drop(pool: Pool, conn: WireConnection) -> None:
    conn.close()
    pool.free_slot()
