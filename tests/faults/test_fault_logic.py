"""The pure parts of fault handling: outlier ejection, panic, rise/fall, breaker, retry budget."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.api.limits import bearer_key, key_allowed
from proxy.config import HealthConfig
from proxy.gateway.retry_budget import RetryBudget
from proxy.state.base import StoreUnavailable
from proxy.state.breaker import CircuitBreaker
from proxy.upstream.health import BackendHealth


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def health(names: list[str], clock: Clock, **outlier: float) -> BackendHealth:
    cfg = HealthConfig.model_validate(
        {
            "outlier": {
                "consecutive_failures": 3,
                "base_ejection_s": 10,
                "max_ejection_s": 25,
                **outlier,
            },
            "active": {"rise": 2, "fall": 2},
        }
    )
    return BackendHealth(names, cfg, clock)


def test_consecutive_failures_eject_for_growing_capped_time() -> None:
    c = Clock()
    h = health(["a", "b", "c", "d"], c)
    assert not h.failure("a") and not h.failure("a")
    h.success("a")  # a success resets the run
    assert not h.failure("a") and not h.failure("a")
    assert h.failure("a")  # the third in a row ejects
    assert h.avoid() == {"a"}
    c.t += 10.1
    assert h.avoid() == frozenset()
    for _ in range(3):
        h.failure("a")
    assert h.snapshot()["a"]["ejected_for_s"] == 20.0  # 10 s x 2nd ejection
    c.t += 20.1
    for _ in range(3):
        h.failure("a")
    assert h.snapshot()["a"]["ejected_for_s"] == 25.0  # capped


def test_never_more_than_max_ejection_percent() -> None:
    c = Clock()
    h = health(["a", "b", "c", "d"], c, max_ejection_percent=50)
    for name in ("a", "b", "c"):
        for _ in range(3):
            h.failure(name)
    assert h.avoid() == {"a", "b"}  # c stays: 3 of 4 would be over 50%


def test_panic_routes_to_all_when_most_are_unhealthy() -> None:
    c = Clock()
    h = health(["a", "b", "c"], c, panic_threshold_percent=50)
    for _ in range(2):
        h.probe_result("a", False)
    assert h.avoid() == {"a"}  # 2 of 3 left: no panic
    for _ in range(2):
        h.probe_result("b", False)
    assert h.avoid() == frozenset()  # 1 of 3 left (33%): route to all
    assert h.panics_total == 1


def test_active_checks_rise_and_fall() -> None:
    c = Clock()
    h = health(["a", "b", "c"], c)
    h.probe_result("a", False)
    assert h.avoid() == frozenset()  # one failure is not `fall`
    h.probe_result("a", False)
    assert h.avoid() == {"a"}
    h.probe_result("a", True)
    assert h.avoid() == {"a"}  # one success is not `rise`
    h.probe_result("a", True)
    assert h.avoid() == frozenset()


def test_cooldown_from_retry_after() -> None:
    c = Clock()
    h = health(["a", "b", "c"], c)
    h.cooldown("a", 5)
    assert h.avoid() == {"a"}
    c.t += 5.1
    assert h.avoid() == frozenset()


def test_retry_budget_share_with_minimum() -> None:
    b = RetryBudget(percent=20, min_concurrency=3)
    assert [b.try_acquire(active_requests=5) for _ in range(4)] == [True, True, True, False]
    assert b.exhausted_total == 1
    b.release(3)
    assert sum(b.try_acquire(active_requests=100) for _ in range(30)) == 20  # 20% of 100
    none = RetryBudget(percent=0, min_concurrency=0)
    assert not none.try_acquire(1000)


async def test_breaker_opens_fails_fast_then_probes_and_closes() -> None:
    c = Clock()
    br = CircuitBreaker(failures=2, open_s=1.0, clock=c)
    calls = 0

    async def down() -> int:
        nonlocal calls
        calls += 1
        raise StoreUnavailable("down")

    async def up() -> int:
        nonlocal calls
        calls += 1
        return 7

    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            await br.call(down)
    assert br.state == "open" and calls == 2
    with pytest.raises(StoreUnavailable):
        await br.call(up)  # open: not even tried
    assert calls == 2
    c.t += 1.1
    probe = asyncio.ensure_future(br.call(up))
    await asyncio.sleep(0)
    assert await probe == 7 and br.state == "closed"
    # A failing probe re-opens at once.
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            await br.call(down)
    c.t += 1.1
    with pytest.raises(StoreUnavailable):
        await br.call(down)
    assert br.state == "open" and br.opened_total == 3  # opened, re-opened, failed probe


async def test_breaker_cancelled_probe_does_not_wedge() -> None:
    c = Clock()
    br = CircuitBreaker(failures=1, open_s=1.0, clock=c)

    async def down() -> None:
        raise StoreUnavailable("x")

    async def hang() -> None:
        await asyncio.sleep(30)

    with pytest.raises(StoreUnavailable):
        await br.call(down)
    c.t += 2
    t = asyncio.ensure_future(br.call(hang))
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t

    async def ok() -> int:
        return 1

    assert await br.call(ok) == 1 and br.state == "closed"


def test_api_key_compare() -> None:
    keys = [b"k-one", b"k-two"]
    assert (
        key_allowed(b"k-two", keys)
        and not key_allowed(b"k-three", keys)
        and not key_allowed(None, keys)
    )
    assert bearer_key([(b"authorization", b"Bearer  k-one ")]) == b"k-one"
    assert bearer_key([(b"authorization", b"Basic abc")]) is None
    assert bearer_key([]) is None


def test_clock_is_monotonic_by_default() -> None:
    h = BackendHealth(["a"], HealthConfig())
    assert h.clock is time.monotonic


async def test_failed_release_is_retried_until_it_lands() -> None:
    """Redis paused: the release fails and is queued; once Redis answers again it goes through."""
    from proxy.config import StoreConfig
    from proxy.gateway.ledger import ReservationLedger
    from proxy.state.redis_store import RedisStore
    from tests.support.redis_server import RedisInstance

    with RedisInstance() as redis_server:
        # The ledger's store gives up quickly, so the release during the pause fails; the
        # test's own reads use a patient store, so a loaded machine cannot fail them.
        store = RedisStore(StoreConfig(redis_url=redis_server.url, op_timeout_s=0.5))
        checker = RedisStore(StoreConfig(redis_url=redis_server.url, op_timeout_s=10))
        breaker = CircuitBreaker(failures=2, open_s=0.2)
        ledger = ReservationLedger(store, breaker, ttl_s=600, retry_interval_s=0.1)
        try:
            assert await checker.reserve("n1", "r1", 100, time.time(), 600, check_fit=False)
            ledger.hold("n1", "r1")
            redis_server.pause()
            try:
                await ledger.release("n1", "r1")
                assert ledger.pending and not ledger.held
            finally:
                redis_server.resume()
            # A bound, not a measure: it ends as soon as the release lands.
            for _ in range(1_200):
                if not ledger.pending:
                    break
                await asyncio.sleep(0.05)
            assert not ledger.pending
            assert await checker.reservations("n1", time.time()) == []
        finally:
            await ledger.close()
            await store.close()
            await checker.close()
