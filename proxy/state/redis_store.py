"""The Redis state store: shared by every gateway replica (and by custom servers that push).

The StateStore implementation over Redis: the key names and value encoding live in
redis_codec.py (the schema outside writers follow, docs/redis-schema.md), the atomic
read-modify-write operations in redis_scripts.py, the connection (single server, Sentinel or
Cluster) in redis_connect.py, the lean path of the per-request reserve and release in
redis_lane.py (single server and Sentinel). This module only issues the calls. The request-path read() is
one read-only script returning every backend's three hashes in one reply (one round trip,
one consistent snapshot). On a Cluster it is one script call per slot, pipelined per node:
each backend's hashes are still read together.

Every call runs under a short deadline (StoreConfig.op_timeout_s) with at most one retry
on connection errors and timeouts; anything else from Redis, or the retry failing too,
becomes StoreUnavailable, so the request path never hangs on the store and never sees a
raw redis exception.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state.base import (
    BackendState,
    Reservation,
    StateStore,
    StoreUnavailable,
    check_finite,
    check_reserve_args,
    check_tokens,
    check_ttl,
    live_reservations,
)
from proxy.state.deadline import lag_tolerant_timeout
from proxy.state.lease import Lease, LeaseRound, lease_field
from proxy.state.redis_codec import (
    RES_KEY_SLACK_MS,
    RedisKeys,
    counting_reservations,
    glob_escape,
    redis_float,
    report_fields,
    states_from_replies,
    ttl_ms,
)
from proxy.state.redis_connect import connect
from proxy.state.redis_lane import RedisLane
from proxy.state.redis_lease import RedisLeases
from proxy.state.redis_scripts import (
    LUA_FORGET,
    LUA_READ,
    LUA_RESERVE,
    LUA_SET_CEILING,
    LUA_SHRINK,
    LUA_TRY_LOCK,
    LUA_UNLOCK,
)
from proxy.state.redis_slots import read_per_slot, scan_keys

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 64


class RedisStore(StateStore):
    """The shared store. Creating it does no I/O; connections are made on first use."""

    def __init__(self, cfg: StoreConfig, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self._timeout = cfg.op_timeout_s
        self._keys = RedisKeys(cfg.key_prefix)
        self._conn = connect(cfg, max_connections)
        self._r = self._conn.client
        # A Cluster refuses MULTI across slots: there the backends-set update is pipelined
        # beside the (single-slot) report write instead of inside one transaction.
        self._cluster = self._conn.cluster
        self._reserve = self._r.register_script(LUA_RESERVE)
        self._set_ceiling = self._r.register_script(LUA_SET_CEILING)
        self._try_lock = self._r.register_script(LUA_TRY_LOCK)
        self._unlock = self._r.register_script(LUA_UNLOCK)
        self._read = self._r.register_script(LUA_READ)
        self._forget = self._r.register_script(LUA_FORGET)
        self._shrink = self._r.register_script(LUA_SHRINK)
        # The per-request reserve and release skip redis-py's command machinery (see
        # redis_lane.py); a Cluster keeps redis-py's slot routing.
        self._lane = None if self._cluster else RedisLane(self._r.connection_pool, max_connections)
        self._leases = RedisLeases(self._r, self._keys, self._call, cfg.reservation_ttl_s)

    # --- the deadline ---
    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one store operation under the deadline, retrying once on a transient failure."""
        last: BaseException | None = None
        for _attempt in range(2):
            try:
                # The loop's own lag is forgiven once (proxy.state.deadline): not Redis's.
                async with lag_tolerant_timeout(self._timeout):
                    return await op()
            except (TimeoutError, RedisTimeoutError, RedisConnectionError, OSError) as exc:
                last = exc
            except RedisError as exc:
                raise StoreUnavailable(f"redis {what}: {exc}") from exc
        raise StoreUnavailable(
            f"redis {what}: no answer within {self._timeout}s after one retry ({type(last).__name__}: {last})"
        ) from last

    async def _smembers(self, key: str) -> set[str]:
        return cast(set[str], await self._r.smembers(key))  # decode_responses: always str

    # --- reports ---
    async def put_report(self, name: str, report: MemoryReport, ttl_s: float) -> None:
        check_ttl(ttl_s)
        fields = {**report_fields(report), "status": "up", "status_reason": ""}

        async def op() -> None:
            async with self._r.pipeline(transaction=not self._cluster) as pipe:
                pipe.hset(self._keys.state(name), mapping=fields)
                pipe.pexpire(self._keys.state(name), ttl_ms(ttl_s))
                pipe.sadd(self._keys.backends, name)
                await pipe.execute()

        await self._call("put_report", op)

    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        check_ttl(ttl_s)

        async def op() -> None:
            async with self._r.pipeline(transaction=not self._cluster) as pipe:
                pipe.hset(
                    self._keys.state(name), mapping={"status": "down", "status_reason": reason}
                )
                pipe.pexpire(self._keys.state(name), ttl_ms(ttl_s))
                pipe.sadd(self._keys.backends, name)
                await pipe.execute()

        await self._call("mark_down", op)

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        """One script call for every backend: one round trip, one consistent snapshot."""
        unique = list(dict.fromkeys(names))
        if not unique:
            return {}
        keys = [k for n in unique for k in self._keys.backend_hashes(n)]
        if self._cluster:
            unique, results = await read_per_slot(self._r, self._keys, self._call, unique)
        else:
            results = await self._call("read", lambda: self._read(keys=keys))
        return states_from_replies(unique, results, now)

    async def known_backends(self) -> set[str]:
        members = await self._call("known_backends", lambda: self._smembers(self._keys.backends))
        names = set(members)
        # Custom servers that push a state hash but forget the SADD are found by their key.
        head, tail = self._keys.state_head, self._keys.state_tail
        pattern = f"{glob_escape(head)}*{glob_escape(tail)}"
        for key in await scan_keys(self._r, self._call, self._cluster, pattern):
            if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
                names.add(key[len(head) : -len(tail)])
        return names

    # --- reservations ---
    async def reserve(
        self,
        name: str,
        reservation_id: str,
        tokens: int,
        now: float,
        ttl_s: float,
        *,
        check_fit: bool = True,
        headroom: float = 0.0,
        grace_s: float = 0.0,
    ) -> bool:
        check_reserve_args(tokens, now, ttl_s, headroom, grace_s)
        k = self._keys
        keys = [k.state(name), k.res(name), k.gone(name), k.leases(name)]
        lease_args = self._leases.reserve_args(self.lease, name, now)
        args = [
            lease_field(reservation_id, lease_args[0]),
            str(tokens),
            redis_float(now),
            redis_float(now + ttl_s),
            "1" if check_fit else "0",
            redis_float(headroom),
            redis_float(grace_s),
            str(ttl_ms(ttl_s) + RES_KEY_SLACK_MS),
            *lease_args,
        ]
        if not check_fit and self.lease is not None:
            # A re-assert: moved from our earlier ids, not counted twice (LUA_RESERVE).
            args.extend(self.lease.recent)
        lane = self._lane
        if lane is not None:
            sha = self._reserve.sha
            result = await self._call("reserve", lambda: lane.evalsha(sha, LUA_RESERVE, keys, args))
        else:
            result = await self._call("reserve", lambda: self._reserve(keys=keys, args=args))
        return int(result) == 1

    def _field(self, reservation_id: str) -> str:
        """The reservation's field: under our lease's id when we hold one (proxy.state.lease)."""
        lease = self.lease
        return lease_field(reservation_id, lease.id) if lease is not None else reservation_id

    def _fields_held(self, reservation_id: str) -> list[str]:
        """The fields a release deletes: under our lease's id, and under our last few ids."""
        lease = self.lease
        if lease is None:
            return [reservation_id]
        ids = (lease.id, *lease.recent)
        return [lease_field(reservation_id, i) for i in ids if i]

    async def release(self, name: str, reservation_id: str) -> None:
        key, fields = self._keys.res(name), self._fields_held(reservation_id)
        lane = self._lane
        if lane is not None:
            await self._call("release", lambda: lane.command("HDEL", key, *fields))
        else:
            await self._call("release", lambda: self._r.hdel(key, *fields))

    async def release_many(self, items: list[tuple[str, str]]) -> None:
        """Every HDEL in one write and one round trip (the gateway batches the releases of
        requests that end in the same loop turn)."""
        lane = self._lane
        if lane is None or len(items) == 1:
            for name, reservation_id in items:
                await self.release(name, reservation_id)
            return
        commands = [("HDEL", self._keys.res(name), *self._fields_held(rid)) for name, rid in items]
        await self._call("release", lambda: lane.pipeline(commands))

    async def shrink(self, name: str, reservation_id: str, tokens: int) -> bool:
        check_tokens(tokens)
        keys, args = [self._keys.res(name)], [self._field(reservation_id), str(tokens)]
        return int(await self._call("shrink", lambda: self._shrink(keys=keys, args=args))) == 1

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        check_finite(until=until)
        keys = [self._keys.res(name), self._keys.gone(name)]
        # The key must outlive the tombstone (its until is on the store's clock, as the TTL is).
        key_ttl = ttl_ms(max(0.0, until - self.now())) + RES_KEY_SLACK_MS
        tail = [redis_float(until), str(key_ttl)]

        async def op() -> None:
            # Under each id of ours a reserve still in flight may carry (an epoch may have
            # turned since it was sent): the marker refuses it whichever it lands under.
            for field in self._fields_held(reservation_id):
                await self._forget(keys=keys, args=[field, *tail])

        await self._call("forget", op)

    async def reservations(self, name: str, now: float) -> list[Reservation]:
        async def op() -> list[Any]:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.hgetall(self._keys.res(name))
                pipe.hgetall(self._keys.leases(name))
                return cast(list[Any], await pipe.execute())

        res, leases = await self._call("reservations", op)
        return list(live_reservations(counting_reservations(res, leases, now), now))

    # --- replica leases (proxy.state.lease, proxy.state.redis_lease) ---
    def hold_lease(self, lease: Lease) -> None:
        super().hold_lease(lease)
        lease.on_new.append(self._leases.on_new)

    async def renew_lease(self, now: float) -> LeaseRound:
        if self.lease is None:
            raise RuntimeError("renew_lease before hold_lease")
        return await self._leases.renew(self.lease, now, self.known_backends)

    async def live_leases(self, now: float) -> dict[str, float]:
        return await self._leases.live(now)

    # --- flags ---
    async def set_draining(self, name: str, draining: bool) -> None:
        value = "1" if draining else "0"
        await self._call(
            "set_draining", lambda: self._r.hset(self._keys.flags(name), "draining", value)
        )

    async def set_cooldown(self, name: str, until: float) -> None:
        check_finite(until=until)
        value = redis_float(until)
        await self._call(
            "set_cooldown", lambda: self._r.hset(self._keys.flags(name), "cooldown_until", value)
        )

    async def set_ceiling(self, name: str, tokens: int, now: float, until: float) -> None:
        check_tokens(tokens)
        check_finite(now=now, until=until)
        keys = [self._keys.flags(name), self._keys.state(name)]
        args = [str(tokens), redis_float(now), redis_float(until)]
        await self._call("set_ceiling", lambda: self._set_ceiling(keys=keys, args=args))

    # --- retry memory ---
    async def add_failed(self, retry_key: str, name: str, ttl_s: float) -> None:
        check_ttl(ttl_s)

        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.sadd(self._keys.retry(retry_key), name)
                pipe.pexpire(self._keys.retry(retry_key), ttl_ms(ttl_s))
                await pipe.execute()

        await self._call("add_failed", op)

    async def failed_on(self, retry_key: str) -> set[str]:
        return await self._call("failed_on", lambda: self._smembers(self._keys.retry(retry_key)))

    # --- coordination ---
    async def try_lock(self, lock: str, owner: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        keys, args = [self._keys.lock(lock)], [owner, str(ttl_ms(ttl_s))]
        result = await self._call("try_lock", lambda: self._try_lock(keys=keys, args=args))
        return int(result) == 1

    async def unlock(self, lock: str, owner: str) -> None:
        keys, args = [self._keys.lock(lock)], [owner]
        await self._call("unlock", lambda: self._unlock(keys=keys, args=args))

    # --- events ---
    async def append_event(self, event: dict[str, Any], max_len: int = 1000) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        raw = orjson.dumps(event).decode()

        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.lpush(self._keys.events, raw)
                pipe.ltrim(self._keys.events, 0, max_len - 1)
                await pipe.execute()

        await self._call("append_event", op)

    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        if limit < 1:
            return []
        items = await self._call("events", lambda: self._r.lrange(self._keys.events, 0, limit - 1))
        out: list[dict[str, Any]] = []
        for raw in items:
            try:
                item = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a foreign writer's junk does not break the log
            if isinstance(item, dict):
                out.append(item)
        return out

    # --- the shared clock ---
    async def server_time(self) -> float:
        """Redis ``TIME`` as unix seconds: the one clock every replica compares shared times on."""
        sec, usec = await self._call("time", lambda: self._r.time())
        return float(sec) + float(usec) / 1e6

    async def sync_clock(self, samples: int = 3) -> float:
        """Measure ``clock_offset`` (Redis clock minus ours), keeping the lowest-RTT sample.

        The server read its clock somewhere inside the round trip; assuming the middle, the
        error is at most half the RTT, so the quickest of a few samples is the most exact.
        """
        best: tuple[float, float] | None = None
        for _ in range(samples):
            t0 = time.time()
            server = await self.server_time()
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, server - (t0 + t1) / 2.0)
        assert best is not None
        self.clock_offset = best[1]
        return self.clock_offset

    # --- lifecycle ---
    async def ping(self) -> bool:
        try:
            return bool(await self._call("ping", lambda: self._r.ping()))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        if self._lane is not None:
            await self._lane.close()
        await self._conn.close()
