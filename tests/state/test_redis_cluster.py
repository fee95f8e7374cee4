"""Redis Cluster specifics, on a real 3-master cluster (tests/support/redis_server.py).

The contract suite (tests/state/test_state_contract.py) already runs every store behaviour on the
cluster; this checks the layout that makes that possible: one backend's keys share a slot,
backends spread over the nodes, the per-slot read returns every backend, and
``known_backends`` finds pushed state keys on every primary.
"""

from __future__ import annotations

import time

import redis
from redis.crc import key_slot

from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state import RedisStore
from tests.support.redis_server import RedisClusterProcs

NAMES = [f"gpu-{i:02d}" for i in range(12)]


def report(largest: int, now: float) -> MemoryReport:
    return MemoryReport(
        capacity_tokens=100_000,
        free_tokens=60_000,
        largest_free_block_tokens=largest,
        reported_at=now,
        started_at=now - 60,
    )


async def test_keys_share_a_slot_and_reads_span_the_nodes(redis_cluster: RedisClusterProcs) -> None:
    redis_cluster.flushall()
    store = RedisStore(StoreConfig(redis_url=redis_cluster.url, cluster=True, op_timeout_s=2.0))
    now = time.time()
    try:
        for i, name in enumerate(NAMES):
            await store.put_report(name, report(10_000 + i, now), 60)
            assert await store.reserve(name, "r1", 1_000 + i, now, 60)
            await store.set_draining(name, i % 2 == 0)
        states = await store.read(NAMES, now)
        assert sorted(states) == NAMES
        for i, name in enumerate(NAMES):
            st = states[name]
            assert st.report is not None and st.report.largest_free_block_tokens == 10_000 + i
            assert [r.tokens for r in st.reservations] == [1_000 + i]
            assert st.flags.draining == (i % 2 == 0)
    finally:
        await store.close()
    owners: set[int] = set()
    for node in redis_cluster.nodes:
        r = redis.Redis(port=node.port, decode_responses=True)
        try:
            keys = list(r.keys("kvroute:backend:*"))
        finally:
            r.close()
        if keys:
            owners.add(node.port)
        by_backend: dict[str, set[str]] = {}
        for k in keys:
            by_backend.setdefault(k.split("{", 1)[1].split("}", 1)[0], set()).add(k)
        # Each backend's :state, :res and :flags live together on one node, in one slot.
        for name, ks in by_backend.items():
            assert {k.rsplit(":", 1)[1] for k in ks} == {"state", "res", "flags"}, name
            assert len({key_slot(k.encode()) for k in ks}) == 1
    assert len(owners) >= 2  # the fleet read really crossed nodes


async def test_known_backends_scans_every_primary(redis_cluster: RedisClusterProcs) -> None:
    redis_cluster.flushall()
    admin = redis.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    try:
        # Custom servers that push their state hash but forget the SADD.
        for name in NAMES:
            admin.hset(f"kvroute:backend:{{{name}}}:state", mapping={"capacity_tokens": "1"})
    finally:
        admin.close()
    store = RedisStore(StoreConfig(redis_url=redis_cluster.url, cluster=True, op_timeout_s=2.0))
    try:
        assert await store.known_backends() == set(NAMES)
    finally:
        await store.close()
