"""Replica leases in Redis (proxy.state.lease): the renewal, the sweep, the live list.

Keys: ``P:leases`` (ZSET, one key: lease id scored by the time it runs to) says which
replicas are alive and is where a lapse is found, by exactly one replica (LUA_LEASE is
atomic). ``P:backend:{name}:leases`` (HASH, in the backend's slot) is the copy the reserve
and read scripts compare reservations against, so on a Cluster every script still touches
one slot. A renewal writes the set and the copy on every backend this lease reserved on
(pipelined: one batch per node on a Cluster); a lapse found is swept off every known backend.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, cast

from proxy.state.lease import Lease, LeaseRound
from proxy.state.redis_codec import RES_KEY_SLACK_MS, RedisKeys, redis_float, ttl_ms
from proxy.state.redis_scripts import LUA_LEASE, LUA_LEASE_SWEEP

Call = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


class RedisLeases:
    """One store's lease operations; ``leased`` is where the current lease has entries."""

    def __init__(self, client: Any, keys: RedisKeys, call: Call, entry_ttl_s: float) -> None:
        self._r = client
        self._keys = keys
        self._call = call
        # A backend's lease copy outlives the reservations it vouches for.
        self._entry_ttl_ms = ttl_ms(entry_ttl_s) + RES_KEY_SLACK_MS
        self._lease = client.register_script(LUA_LEASE)
        self.leased: set[str] = set()
        self._retired_on: set[str] = set()  # where our earlier ids had entries

    def on_new(self, _lease_id: str) -> None:
        """A new id has entries nowhere yet."""
        self._retired_on |= self.leased
        self.leased = set()

    def reserve_args(self, lease: Lease | None, name: str, now: float) -> list[str]:
        """The reserve script's lease arguments (and ``name`` noted for the renewals)."""
        if lease is None:
            return ["", "0"]
        lease_id = lease.current(now)
        self.leased.add(name)
        return [lease_id, redis_float(lease.until)]

    async def renew(
        self, lease: Lease, now: float, backends: Callable[[], Awaitable[set[str]]]
    ) -> LeaseRound:
        lease.current(now)
        new = not lease.registered
        lapsed = await self._register(lease, now, fresh=new)
        if lapsed is None:
            lease.next_epoch(now)  # lapsed, perhaps swept: register anew
            new = True
            lapsed = await self._register(lease, now, fresh=True)
            assert lapsed is not None
        # Ours runs on only once every backend's copy says so too.
        await self._extend(lease, now + lease.ttl_s)
        lease.renewed(now)
        dropped, tokens = await self._sweep_all(lapsed, now, backends) if lapsed else (0, 0)
        if lease.retired:
            # Our own earlier lives: re-asserted under the new id, their fields are garbage.
            retired_on = set(self._retired_on)

            async def where() -> set[str]:
                return retired_on | await backends()

            await self._sweep_all(tuple(lease.retired), now, where)
            lease.retired.clear()
            self._retired_on -= retired_on
        return LeaseRound(lease.id, new, lapsed, dropped, tokens)

    async def _register(self, lease: Lease, now: float, *, fresh: bool) -> tuple[str, ...] | None:
        """Renew (or add) our entry in the lease set; the lapsed ids it removed, None if ours lapsed."""
        keys = [self._keys.leases_set]
        args = [lease.id, redis_float(now), redis_float(now + lease.ttl_s), "1" if fresh else "0"]
        reply = await self._call("lease", lambda: self._lease(keys=keys, args=args))
        if int(reply[0]) != 1:
            return None
        return tuple(str(x) for x in reply[1:])

    async def _extend(self, lease: Lease, runs_to: float) -> None:
        """The lease's copy on every backend it reserved on, run to its new time."""
        names = sorted(self.leased)
        if not names:
            return
        until, entry_ttl = redis_float(runs_to), self._entry_ttl_ms

        async def op() -> None:
            async with self._r.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hset(self._keys.leases(name), lease.id, until)
                    pipe.pexpire(self._keys.leases(name), entry_ttl)
                await pipe.execute()

        await self._call("lease", op)

    async def _sweep_all(
        self, lapsed: tuple[str, ...], now: float, backends: Callable[[], Awaitable[set[str]]]
    ) -> tuple[int, int]:
        """Delete the lapsed leases' reservations and entries on every known backend."""
        names = sorted(await backends())
        if not names:
            return 0, 0
        args = [redis_float(now), *lapsed]

        async def op() -> list[Any]:
            async with self._r.pipeline(transaction=False) as pipe:
                for name in names:
                    keys = [self._keys.res(name), self._keys.leases(name)]
                    # EVAL, not EVALSHA: rare, and nothing to reload after a Redis restart.
                    pipe.eval(LUA_LEASE_SWEEP, len(keys), *keys, *args)
                return cast(list[Any], await pipe.execute())

        replies = await self._call("lease sweep", op)
        return sum(int(r[0]) for r in replies), sum(int(r[1]) for r in replies)

    async def live(self, now: float) -> dict[str, float]:
        key, low = self._keys.leases_set, f"({redis_float(now)}"
        reply = await self._call(
            "leases", lambda: self._r.zrangebyscore(key, low, "+inf", withscores=True)
        )
        return {str(i): float(s) for i, s in reply if math.isfinite(float(s))}
