"""The ledger re-asserts what this gateway holds after the store lost it (real redis-server).

A restarted, empty Redis stands for a Sentinel failover whose new master missed the last
writes: requests placed meanwhile still hold memory on their node, so the store must count
them again before it admits more, or the node is over-committed.
"""

from __future__ import annotations

import time

from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.gateway.ledger import ReservationLedger
from proxy.state.breaker import CircuitBreaker
from proxy.state.redis_store import RedisStore
from tests.support.redis_server import RedisInstance

TTL = 60.0


def report(largest: int, at: float) -> MemoryReport:
    return MemoryReport(
        capacity_tokens=60_000,
        free_tokens=largest,
        largest_free_block_tokens=largest,
        reported_at=at,
    )


async def test_reassert_restores_lost_reservations_so_nothing_over_commits() -> None:
    with RedisInstance() as server:
        store = RedisStore(StoreConfig(redis_url=server.url, op_timeout_s=0.5))
        ledger = ReservationLedger(store, CircuitBreaker(failures=3, open_s=0.1), ttl_s=TTL)
        try:
            t0 = time.time()
            await store.put_report("n1", report(60_000, t0 - 1.0), 60)
            for rid in ("a", "b"):
                assert await store.reserve("n1", rid, 20_000, t0, TTL)
                ledger.hold("n1", rid, tokens=20_000, created_at=t0)
            # The store loses everything (failover to a replica that missed the writes).
            server.restart()
            await store.put_report("n1", report(60_000, t0 - 1.0), 60)
            ledger.mark_unsure()
            # Without re-asserting, the store would admit 50k more on a node that has 20k left.
            await ledger.reassert()
            assert not ledger.store_may_have_lost and ledger.reasserted == 2
            got = {
                r.id: (r.tokens, r.created_at, r.expires_at)
                for r in await store.reservations("n1", time.time())
            }
            assert got == {"a": (20_000, t0, t0 + TTL), "b": (20_000, t0, t0 + TTL)}
            assert not await store.reserve("n1", "c", 30_000, time.time(), TTL)
            assert await store.reserve("n1", "d", 19_000, time.time(), TTL)
            # Released meanwhile: not re-asserted again.
            await ledger.release("n1", "a")
            ledger.mark_unsure()
            await ledger.reassert()
            assert {r.id for r in await store.reservations("n1", time.time())} == {"b", "d"}
        finally:
            await ledger.close(deadline_s=1.0)
            await store.close()


async def test_reassert_while_the_store_is_down_keeps_trying() -> None:
    with RedisInstance() as server:
        store = RedisStore(StoreConfig(redis_url=server.url, op_timeout_s=0.1))
        ledger = ReservationLedger(store, CircuitBreaker(failures=3, open_s=0.1), ttl_s=TTL)
        try:
            t0 = time.time()
            ledger.hold("n1", "a", tokens=1_000, created_at=t0)
            ledger.mark_unsure()
            server.stop()
            await ledger.reassert()  # fails quietly: still unsure
            assert ledger.store_may_have_lost
            server.restart()
            await ledger.reassert()
            assert not ledger.store_may_have_lost
            assert [r.id for r in await store.reservations("n1", time.time())] == ["a"]
        finally:
            await ledger.close(deadline_s=1.0)
            await store.close()
