"""The shared placement stream (proxy/state/prefix_share.py) on a real redis-server.

Two ``PrefixShare`` instances stand for two gateway replicas; their learners record what
each is told. Time is an injected clock (placements carry the store's time).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Any

import orjson
import redis

from proxy.config import Config
from proxy.state.prefix_share import PrefixShare, decode_hashes, encode_hashes
from proxy.state.redis_connect import SOCKET_TIMEOUT_FLOOR_S, connect
from tests.support.gateway import gateway_cfg
from tests.support.redis_server import RedisInstance, free_port


class Learner:
    def __init__(self) -> None:
        self.got: list[tuple[str, tuple[int, ...], str | None, float]] = []

    def learn(
        self, node: str, hashes: Sequence[int], session: str | None, placed_at: float
    ) -> None:
        self.got.append((node, tuple(hashes), session, placed_at))


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def config(url: str, prefix: str, **share: Any) -> Config:
    p = {"share": True, "share_poll_s": 0.05, **share}
    return gateway_cfg(
        [{"name": "a", "url": "http://127.0.0.1:9"}],
        store={"redis_url": url, "key_prefix": prefix},
        routing={"prefix": p},
    )


def replica(cfg: Config, clock: Clock) -> tuple[PrefixShare, Learner]:
    learner = Learner()
    share = PrefixShare.from_config(cfg, lambda: learner, clock)
    assert share is not None
    return share, learner


def test_hashes_round_trip_and_garbage_decodes_to_nothing() -> None:
    hashes = [0, 1, 2**64 - 1, 12345678901234567]
    assert decode_hashes(encode_hashes(hashes)) == tuple(hashes)
    assert decode_hashes("not base64!") == ()
    assert decode_hashes("AAAA") == ()  # 3 bytes: not whole hashes


def test_sharing_is_on_by_default_with_redis_and_needs_a_redis_store(redis_server: str) -> None:
    learner = Learner()
    backends = [{"name": "a", "url": "http://127.0.0.1:9"}]
    plain = gateway_cfg(backends, store={"redis_url": redis_server})
    share = PrefixShare.from_config(plain, lambda: learner, Clock())
    assert share is not None
    asyncio.run(share.close())
    off = gateway_cfg(
        backends, store={"redis_url": redis_server}, routing={"prefix": {"share": False}}
    )
    assert PrefixShare.from_config(off, lambda: learner, Clock()) is None
    no_affinity = gateway_cfg(
        backends, store={"redis_url": redis_server}, routing={"prefix": {"enabled": False}}
    )
    assert PrefixShare.from_config(no_affinity, lambda: learner, Clock()) is None
    # The embedded store is one process: nothing to share with.
    assert PrefixShare.from_config(gateway_cfg(backends), lambda: learner, Clock()) is None


def test_a_replica_learns_what_another_placed_and_not_its_own(redis_server: str) -> None:
    cfg = config(redis_server, "t-" + secrets.token_hex(4))
    clock = Clock()

    async def go() -> None:
        a, learned_a = replica(cfg, clock)
        b, learned_b = replica(cfg, clock)
        try:
            a.publish("v1", (11, 22, 33), "m|s1", clock.now)
            await a.round()
            await b.round()
            assert learned_b.got == [("v1", (11, 22, 33), "m|s1", clock.now)]
            assert learned_a.got == []
            # Nothing twice: the next round reads only what is new.
            b.publish("v0", (44,), None, clock.now)
            await b.round()
            await a.round()
            await b.round()
            assert learned_a.got == [("v0", (44,), None, clock.now)]
            assert len(learned_b.got) == 1
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_a_starting_replica_catches_up_on_the_last_ttl_only(redis_server: str) -> None:
    cfg = config(redis_server, "t-" + secrets.token_hex(4), ttl_s=60.0)
    clock = Clock()

    async def go() -> None:
        a, _ = replica(cfg, clock)
        try:
            a.publish("v0", (1,), None, clock.now - 120.0)  # placed long ago: evicted since
            a.publish("v1", (2,), None, clock.now)
            await a.round()
        finally:
            await a.close()
        late, learned = replica(cfg, clock)
        try:
            await late.round()
        finally:
            await late.close()
        assert [g[0] for g in learned.got] == ["v1"]

    asyncio.run(go())


def test_the_stream_is_bounded_and_expires(redis_server: str) -> None:
    prefix = "t-" + secrets.token_hex(4)
    cfg = config(redis_server, prefix, share_max_entries=50, share_max_blocks=8, ttl_s=30.0)
    clock = Clock()

    async def go() -> None:
        a, _ = replica(cfg, clock)
        try:
            for i in range(400):
                a.publish("v0", list(range(i, i + 100)), None, clock.now)
                if i % 100 == 99:
                    await a.round()
        finally:
            await a.close()

    asyncio.run(go())
    r = redis.Redis.from_url(redis_server)
    key = f"{prefix}:prefix:placed"
    # MAXLEN ~ 50: Redis trims whole nodes of entries, so a little over 50, far under 400.
    assert 50 <= r.xlen(key) < 200
    _, fields = r.xrevrange(key, count=1)[0]
    # One placement per entry here (8 hashes each, the cap per placement and per entry).
    (placement,) = orjson.loads(fields[b"p"])
    assert len(decode_hashes(placement[2])) == 8
    assert 0 < r.pttl(key) <= 30_000


def test_placements_wait_while_redis_is_away_and_go_out_when_it_is_back(tmp_path: Any) -> None:
    server = RedisInstance(tmp_path, port=free_port()).start()
    try:
        cfg = config(server.url, "t-" + secrets.token_hex(4))
        clock = Clock()

        async def go() -> None:
            a, _ = replica(cfg, clock)
            b, learned = replica(cfg, clock)
            try:
                server.stop()
                a.publish("v1", (7, 8), None, clock.now)
                failed = False
                try:
                    await asyncio.wait_for(a.round(), 10)
                except (redis.exceptions.RedisError, OSError):
                    failed = True
                assert failed
                server.restart()
                await a.round()
                await b.round()
                assert learned.got == [("v1", (7, 8), None, clock.now)]
            finally:
                await a.close()
                await b.close()

        asyncio.run(go())
    finally:
        server.close()


def test_connect_is_the_stores_client() -> None:
    # The share uses the store's connection discipline (timeouts, no library retries).
    cfg = config("redis://127.0.0.1:9/0", "x")
    client = connect(cfg.store, max_connections=2)
    kwargs = client.client.connection_pool.connection_kwargs
    # redis-py's own timeouts are a backstop above the store's deadline, never below it.
    assert kwargs["socket_timeout"] == max(cfg.store.op_timeout_s, SOCKET_TIMEOUT_FLOOR_S)
    assert kwargs["socket_connect_timeout"] == kwargs["socket_timeout"]


def test_a_round_sends_its_placements_in_one_entry_within_the_block_cap(redis_server: str) -> None:
    prefix = "t-" + secrets.token_hex(4)
    cfg = config(redis_server, prefix, share_max_blocks=100)
    clock = Clock()

    async def go() -> None:
        a, _ = replica(cfg, clock)
        b, learned = replica(cfg, clock)
        try:
            for i in range(9):
                a.publish(f"v{i % 2}", list(range(i, i + 10)), None, clock.now)
            await a.round()
            # 90 hashes: one entry (one XADD) for the whole round, whatever the request rate.
            assert redis.Redis.from_url(redis_server).xlen(f"{prefix}:prefix:placed") == 1
            for i in range(30):
                a.publish("v0", list(range(i, i + 10)), None, clock.now)
            await a.round()
            # 300 hashes, at most 100 per entry: three more entries.
            assert redis.Redis.from_url(redis_server).xlen(f"{prefix}:prefix:placed") == 4
            await b.round()
            assert len(learned.got) == 39
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())
