"""Upstream connections and the byte relay: the gateway's hot path.

The POSTs to backends go through the lean client (``proxy.upstream.lean_client``: asyncio +
httptools, ``upstream.client: lean``) or aiohttp's (``upstream.client: aiohttp``); both
answers have the shape of ``UpstreamAnswer`` and every library error becomes one of
``proxy.errors``' ``UpstreamError`` here. aiohttp stays for GETs (health probes, admin):
it measured ~12x httpx.AsyncClient's throughput as a proxy client on this class of machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import aiohttp
from starlette.datastructures import Headers

from proxy.config import UpstreamConfig
from proxy.errors import (
    AnswerTooLarge as AnswerTooLarge,
)
from proxy.errors import (
    BodyTimeout as BodyTimeout,
)
from proxy.errors import (
    UpstreamBroken as UpstreamBroken,
)
from proxy.errors import (
    UpstreamConnectError as UpstreamConnectError,
)
from proxy.errors import (
    UpstreamTimeout as UpstreamTimeout,
)
from proxy.errors import WireError
from proxy.upstream import lean_client as lean
from proxy.upstream.wire import BodyReader

# RFC 9110 7.6.1 hop-by-hop fields, plus fields the proxy recomputes itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "expect",
    }
)
_RESPONSE_DROP = frozenset(HOP_BY_HOP | {"content-encoding", "date", "server"})


# The gateway's own credentials: checked here, never forwarded (a backend must not learn them).
ADMIN_HEADERS = frozenset({"x-admin-key"})
# What ``forward_headers`` drops, built once rather than per request.
_DROP = HOP_BY_HOP | ADMIN_HEADERS
_DROP_WITH_AUTH = _DROP | {"authorization"}


def forward_headers(headers: Mapping[str, str], strip_authorization: bool) -> dict[str, str]:
    """Request headers to send upstream: end-to-end ones, less the gateway's own credentials.

    ``strip_authorization`` is true when ``Authorization`` carried a gateway key
    (``auth.api_keys``); otherwise it is the client's business with the backend and passes.
    """
    dropped = _DROP_WITH_AUTH if strip_authorization else _DROP
    out: dict[str, str] = {}
    conn: str | None = None
    # One pass that also finds Connection: a header looked up and missing (the usual case)
    # costs Starlette a KeyError.
    for k, v in headers.items():
        lk = k.lower()
        if lk == "connection" and conn is None:
            conn = v
        if lk not in dropped:
            out[k] = v
    if conn:
        listed = {h.strip().lower() for h in conn.split(",") if h.strip()}
        out = {k: v for k, v in out.items() if k.lower() not in listed}
    return out


#: The header vLLM's and SGLang's OpenAI servers read to put a request on one data-parallel
#: engine instead of letting their front end choose (vLLM: ``_get_data_parallel_rank``).
DP_RANK_HEADER = "x-data-parallel-rank"


def with_engine(headers: dict[str, str], engine: int) -> dict[str, str]:
    """``headers`` pinning the request to data-parallel ``engine`` (a client's own pin replaced:
    the gateway accounts for the engine it chose)."""
    out = {k: v for k, v in headers.items() if k.lower() != DP_RANK_HEADER}
    out[DP_RANK_HEADER] = str(engine)
    return out


def header(headers: Headers, name: str) -> str | None:
    """``headers.get(name)`` (the first value), for a lowercase ``name``, without the KeyError
    that Starlette's ``get`` raises and catches for a missing header (profiled: ~1 us each,
    several per request)."""
    key = name.encode("latin-1")
    for k, v in headers.raw:
        if k == key:
            return v.decode("latin-1")
    return None


def with_credential(headers: dict[str, str], credential: str | None) -> dict[str, str]:
    """``headers`` with the backend's own credential (``backends[].api_key``) in place of the client's."""
    if credential is None:
        return headers
    out = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    out["authorization"] = credential
    return out


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    conn = headers.get("connection", "")
    listed = {h.strip().lower() for h in conn.split(",") if h.strip()}
    return {
        k: v
        for k, v in headers.items()
        if (lk := k.lower()) not in _RESPONSE_DROP and lk not in listed
    }


class BodyStream(Protocol):
    """The reading surface of an answer's body (aiohttp's StreamReader has it, so does lean's)."""

    def read_nowait(self) -> bytes: ...
    def at_eof(self) -> bool: ...
    async def readany(self) -> bytes: ...
    def iter_any(self) -> AsyncIterator[bytes]: ...
    def set_exception(self, exc: BaseException) -> None: ...


class UpstreamAnswer(Protocol):
    """An answer whose head arrived; ``close`` drops its connection, ``release`` returns it."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content(self) -> BodyStream: ...
    def close(self) -> None: ...
    def release(self) -> Any: ...


# Library errors (and the lean client's) that mean "the connection broke" while a body was read.
_BROKEN = (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, WireError)


class _MapBroken:
    """Translate aiohttp's and the socket's errors into UpstreamBroken (the httpx mapping habit).

    A class with one shared instance, not a ``contextlib.contextmanager``: that built a
    generator and its manager around every read of an answer's body (two per tiny answer).
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A TimeoutError is an OSError, but a timeout (the lean reader's own timer), not a break.
        if (
            exc_type is not None
            and issubclass(exc_type, _BROKEN)
            and not issubclass(exc_type, TimeoutError)
        ):
            raise UpstreamBroken(exc_type.__name__) from exc


_map_broken = _MapBroken()


@dataclass(slots=True)
class Upstream:
    cfg: UpstreamConfig
    session: aiohttp.ClientSession | None = None
    pool: lean.Pool | None = None

    async def start(self) -> None:
        if self.cfg.client == "lean":
            self.pool = lean.Pool(self.cfg)
        connector = aiohttp.TCPConnector(
            limit=self.cfg.max_connections,
            limit_per_host=0,
            ttl_dns_cache=60,
            keepalive_timeout=30,
        )
        # Reads are bounded by the gateway itself (TTFB, idle gap, total: each answered
        # differently), so aiohttp's own sock_read timeout stays off.
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.cfg.connect_timeout_s,
            sock_connect=self.cfg.connect_timeout_s,
            sock_read=None,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            raise_for_status=False,
        )

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def post(
        self, url: str, body: bytes, headers: Mapping[str, str], ttfb_s: float | None = None
    ) -> Awaitable[UpstreamAnswer]:
        """Send the request; return once response headers arrived (the body is still to read).

        Not itself a coroutine: it hands back the chosen client's, one layer less per request.
        """
        limit = self.cfg.ttfb_timeout_s if ttfb_s is None else max(0.001, ttfb_s)
        if self.pool is not None:
            return lean.post(self.pool, url, body, headers, limit)
        return self._post_aiohttp(url, body, headers, limit)

    async def _post_aiohttp(
        self, url: str, body: bytes, headers: Mapping[str, str], limit: float
    ) -> UpstreamAnswer:
        assert self.session is not None, "Upstream.start() was not called"
        # Messages name no URL: the caller names the backend (a URL may carry credentials).
        # Redirects are never followed: a 3xx would re-send the prompt somewhere else.
        try:
            async with asyncio.timeout(limit):
                return await self.session.post(
                    url, data=body, headers=headers, allow_redirects=False
                )
        except aiohttp.ConnectionTimeoutError:
            raise UpstreamTimeout(
                f"could not connect within {self.cfg.connect_timeout_s}s", "connect"
            ) from None
        except TimeoutError:
            raise UpstreamTimeout(f"no response within {limit:g}s", "ttfb") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"{exc.__class__.__name__}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            # Connected, then dropped before the headers (a crash, a reset): "broken", not a
            # failure to connect, so logs and kvroute_attempts_total{result} tell them apart.
            raise UpstreamBroken(
                f"closed the connection before answering ({exc.__class__.__name__})"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"{exc.__class__.__name__}") from None
        except (ValueError, aiohttp.ClientError) as exc:
            # A header combination aiohttp refuses is this attempt's failure, never a 500.
            raise UpstreamConnectError(
                f"request refused by the client library: {exc.__class__.__name__}"
            ) from None

    async def get(
        self, url: str, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        assert self.session is not None
        async with (
            asyncio.timeout(timeout_s),
            self.session.get(url, headers=headers, allow_redirects=False) as resp,
        ):
            return resp.status, await read_limited(resp)


async def read_limited(resp: UpstreamAnswer, limit: int = 1 << 20) -> bytes:
    """Read an error body, at most `limit` bytes (an upstream must not make us buffer gigabytes)."""
    chunks: list[bytes] = []
    size = 0
    with _map_broken:
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    return b"".join(chunks)[:limit]


async def next_chunk(resp: UpstreamAnswer, idle_s: float, deadline: float) -> bytes:
    """The next piece of the body (b"" at its end) within the idle gap and the total deadline.

    ``deadline`` is on the loop's clock. Raises BodyTimeout, or UpstreamBroken when the
    connection breaks.
    """
    loop = asyncio.get_running_loop()
    left = deadline - loop.time()
    if left <= 0:
        raise BodyTimeout("the request ran past its total time limit", "total")
    content = resp.content
    # What has arrived already is taken without arming a timer (profiled: a timeout's
    # set-up and tear-down per read was ~5% of a tiny answer's CPU); only a wait is timed.
    with _map_broken:
        ready = content.read_nowait()
    if ready or content.at_eof():
        return ready
    phase = "idle" if idle_s < left else "total"
    try:
        if isinstance(content, BodyReader):
            # The lean client's reader times its own wait (one timer, no timeout scope).
            with _map_broken:
                return await content.readany_by(loop.time() + min(idle_s, left))
        async with asyncio.timeout(min(idle_s, left)):
            with _map_broken:
                return await content.readany()
    except TimeoutError:
        if phase == "idle":
            raise BodyTimeout(f"no data for {idle_s:g}s", "idle") from None
        raise BodyTimeout("the request ran past its total time limit", "total") from None


async def read_body(resp: UpstreamAnswer, idle_s: float, deadline: float, limit: int) -> bytes:
    """The whole body, each read bounded by the idle gap, all of it by the deadline and ``limit`` bytes.

    Raises AnswerTooLarge past ``limit`` (``upstream.max_answer_bytes``): a backend must not
    make the gateway buffer without end.
    """
    chunks: list[bytes] = []
    size = 0
    while chunk := await next_chunk(resp, idle_s, deadline):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"the answer is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
