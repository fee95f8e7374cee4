"""The process's TLS verification context is built once, off the event loop.

Building it reads the CA bundle (17-96 ms measured): built by a client constructor inside a
coroutine, it stalled every request in flight. The collector and the restart hooks use it.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

import httpx
import pytest

from proxy.backends.scrape import scrape_client
from proxy.config import CollectorConfig
from proxy.upstream import tls


@pytest.fixture
def fresh_tls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Forget any context built by earlier tests; record the thread each build runs in."""
    monkeypatch.setattr(tls, "_context", None)
    monkeypatch.setattr(tls, "_building", None)
    builders: list[int] = []
    real = httpx.create_ssl_context

    def recording() -> ssl.SSLContext:
        builders.append(threading.get_ident())
        return real()

    monkeypatch.setattr(httpx, "create_ssl_context", recording)
    return builders


async def test_built_once_in_a_worker_thread_for_concurrent_callers(fresh_tls: list[int]) -> None:
    contexts = await asyncio.gather(*(tls.verifying_context() for _ in range(5)))
    assert len({id(c) for c in contexts}) == 1
    assert contexts[0].verify_mode == ssl.CERT_REQUIRED
    assert len(fresh_tls) == 1
    assert fresh_tls[0] != threading.get_ident(), "the CA bundle was read on the event loop"
    assert await tls.verifying_context() is contexts[0]
    assert len(fresh_tls) == 1


async def test_the_scrape_client_uses_the_shared_context(fresh_tls: list[int]) -> None:
    ctx = await tls.verifying_context()
    client = scrape_client(4, CollectorConfig(), ctx)
    try:
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert pool._ssl_context is ctx
    finally:
        await client.aclose()
    assert len(fresh_tls) == 1
