"""Upstream connections and the byte relay: the gateway's hot path.

aiohttp's client is used for forwarding because it measured ~12x the throughput of
httpx.AsyncClient as a proxy client on this class of machine (see README, Benchmarks);
httpx stays where convenience matters more (scraping, hooks, tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

from proxy.config import UpstreamConfig

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


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Request headers to send upstream: end-to-end ones only (Authorization passes through)."""
    conn = headers.get("connection", "")
    listed = {h.strip().lower() for h in conn.split(",") if h.strip()}
    return {k: v for k, v in headers.items() if (lk := k.lower()) not in HOP_BY_HOP and lk not in listed}


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    conn = headers.get("connection", "")
    listed = {h.strip().lower() for h in conn.split(",") if h.strip()}
    return {k: v for k, v in headers.items() if (lk := k.lower()) not in _RESPONSE_DROP and lk not in listed}


class UpstreamTimeout(Exception):
    """No response headers within the time-to-first-byte limit."""


class UpstreamConnectError(Exception):
    """The backend refused or dropped the connection before answering."""


@dataclass(slots=True)
class Upstream:
    cfg: UpstreamConfig
    session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.cfg.max_connections,
            limit_per_host=0,
            ttl_dns_cache=60,
            keepalive_timeout=30,
        )
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.cfg.connect_timeout_s, sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.idle_timeout_s
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            raise_for_status=False,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        """Send the request; return once response headers arrived (the body is still to read)."""
        assert self.session is not None, "Upstream.start() was not called"
        try:
            async with asyncio.timeout(self.cfg.ttfb_timeout_s):
                return await self.session.post(url, data=body, headers=headers)
        except TimeoutError:
            raise UpstreamTimeout(f"no response from {url} within {self.cfg.ttfb_timeout_s}s") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise UpstreamConnectError(f"{url}: {exc.__class__.__name__}: {exc}") from None

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        assert self.session is not None
        async with asyncio.timeout(timeout_s), self.session.get(url) as resp:
            return resp.status, await resp.read()


async def read_limited(resp: aiohttp.ClientResponse, limit: int = 1 << 20) -> bytes:
    """Read an error body, at most `limit` bytes (an upstream must not make us buffer gigabytes)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


async def iter_body(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Yield the upstream body as it arrives (SSE events are relayed the moment they come)."""
    async for chunk in resp.content.iter_any():
        if chunk:
            yield chunk
