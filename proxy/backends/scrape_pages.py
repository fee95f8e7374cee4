"""The pages a scrape reads besides ``/metrics`` (llama.cpp's ``/props`` and ``/slots``).

Read one after another on the scrape's own client, inside the same deadline as the metrics
page (``proxy.backends.scrape``), each bounded the same way: httpx's per-phase timeouts, a
size cap, and the deadline checked per chunk. A failure raises what the scrape already
turns into an outcome (``ScrapeError``, httpx's errors).
"""

from __future__ import annotations

import time

import httpx

from proxy.backends.samples import ScrapeError
from proxy.config import BackendConfig

MAX_PAGE_BYTES = 4 * 1024 * 1024  # /slots with its sampling params is ~2 KB a slot


async def read_pages(
    client: httpx.AsyncClient,
    backend: BackendConfig,
    paths: tuple[str, ...],
    deadline: float,
    timeout_s: float,
) -> dict[str, bytes]:
    """Each of ``paths`` on ``backend``: path -> body (HTTP 200 only)."""
    cred = backend.credential()
    headers = {"accept": "application/json"}
    if cred is not None:
        headers["authorization"] = cred
    return {
        path: await _read(client, backend.plain_url + path, path, headers, deadline, timeout_s)
        for path in paths
    }


async def _read(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    headers: dict[str, str],
    deadline: float,
    timeout_s: float,
) -> bytes:
    async with client.stream("GET", url, headers=headers) as resp:
        if resp.status_code != 200:
            raise ScrapeError(f"HTTP {resp.status_code} from {path}", "http_status")
        body = bytearray()
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > MAX_PAGE_BYTES:
                raise ScrapeError(f"{path} body larger than {MAX_PAGE_BYTES} bytes")
            if time.perf_counter() > deadline:
                raise ScrapeError(
                    f"timeout after {timeout_s:g}s ({path} still arriving)", "timeout"
                )
    return bytes(body)
