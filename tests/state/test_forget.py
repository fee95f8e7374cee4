"""``forget``: the idempotent release for a reserve whose outcome is unknown, on both stores.

A request cancelled (or timed out) while its reserve call is in flight: the release can
reach Redis before the reserve does. After ``forget`` the late reserve is refused, so no
reservation is left behind; the marker counts as nothing and expires on its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from proxy.config import StoreConfig
from proxy.state.base import StateStore
from proxy.state.memory import InProcessStore
from proxy.state.redis_store import RedisStore

TTL = 60.0


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_server: str) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield InProcessStore()
        return
    prefix = f"kvr-forget-{time.monotonic_ns()}"
    s = RedisStore(StoreConfig(redis_url=redis_server, key_prefix=prefix, op_timeout_s=5.0))
    try:
        yield s
    finally:
        await s.close()


async def test_a_reserve_after_forget_is_refused(store: StateStore) -> None:
    now = store.now()
    await store.forget("n1", "r1", now + TTL)  # the release overtook the reserve
    assert not await store.reserve("n1", "r1", 100, now, TTL, check_fit=False)
    assert await store.reserve("n1", "r2", 100, now, TTL)
    state = (await store.read(["n1"], now))["n1"]
    assert [r.id for r in state.reservations] == ["r2"]
    assert state.overlay(now, 0.0).inflight == 1
    assert [r.id for r in await store.reservations("n1", now)] == ["r2"]


async def test_forget_releases_and_is_idempotent(store: StateStore) -> None:
    now = store.now()
    assert await store.reserve("n1", "r1", 100, now, TTL)
    await store.forget("n1", "r1", now + TTL)
    await store.forget("n1", "r1", now + TTL)
    assert await store.reservations("n1", now) == []


async def test_the_marker_expires(store: StateStore) -> None:
    now = store.now()
    await store.forget("n1", "r1", now + 1.0)
    later = now + 2.0
    assert await store.reserve("n1", "r1", 100, later, TTL)
    assert [r.id for r in await store.reservations("n1", later)] == ["r1"]
