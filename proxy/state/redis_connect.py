"""The Redis client for one of three deployments: a single server, Sentinel, or Cluster.

Every client gets the same discipline (decoded replies, the store's deadline as socket
timeout, no library retries: ``RedisStore._call`` owns the single retry), so the store's
behaviour under faults does not depend on the topology.

- single: ``store.redis_url``; a blocking pool (a burst waits for a connection, bounded by
  the deadline, rather than failing at once).
- Sentinel: ``store.sentinel``; every new connection asks the sentinels for the current
  master, and a connection still open to a demoted master is dropped on its first
  ``READONLY`` reply (redis-py's ``SentinelManagedConnection``), so after a failover the
  next call (or the store's one retry) lands on the new master without a restart.
- Cluster: ``store.cluster: true`` with ``redis_url`` naming any node; redis-py's
  ``RedisCluster`` maps slots to nodes and follows ``MOVED``/``ASK`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from proxy.config import StoreConfig

CLIENT_NAME = "kvroute"


@dataclass
class RedisClient:
    """The connected client and what to close with it; ``cluster`` changes how keys group."""

    client: Any  # redis.asyncio.Redis or RedisCluster: same command methods
    cluster: bool
    closers: tuple[Any, ...] = ()

    async def close(self) -> None:
        await self.client.aclose()
        for extra in self.closers:
            await extra.aclose()


#: redis-py's own socket timeouts, a backstop only. Every store call runs under the store's
#: deadline (``op_timeout_s``, ``proxy.state.deadline``), which tells a slow Redis from a busy
#: gateway loop; redis-py's timeouts cannot (on a busy loop their timer can fire ahead of the
#: read of a reply already in the socket, and the connection is then closed).
SOCKET_TIMEOUT_FLOOR_S = 1.0


def _common(cfg: StoreConfig) -> dict[str, Any]:
    backstop = max(cfg.op_timeout_s, SOCKET_TIMEOUT_FLOOR_S)
    return {
        "socket_timeout": backstop,
        "socket_connect_timeout": backstop,
        # Our own single retry (RedisStore._call) is the only one.
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        "client_name": CLIENT_NAME,
        **_driver_info(),
    }


def _driver_info() -> dict[str, Any]:
    """The client's name and version, resolved once for every connection this store makes.

    redis-py 7+ reads its own version from the package's metadata in each new connection
    (``importlib.metadata``: 0.48 ms of CPU on the quiet 2-core box against 0.011 ms given
    it; ~2 ms under load). A connection is made for every one dropped with a command in flight
    (``proxy.state.redis_lane``), which is when the loop is busiest: after a burst of big
    prompts put the store calls past their deadline, that was ~2% of the loop's time on tiny
    requests. Older redis-py read it once, at import: nothing to pass there.
    """
    try:
        from redis.driver_info import resolve_driver_info
    except ImportError:
        return {}
    return {"driver_info": resolve_driver_info()}


def connect(cfg: StoreConfig, max_connections: int) -> RedisClient:
    """The client for ``cfg``; does no I/O (connections are made on first use)."""
    if cfg.sentinel is not None:
        return _sentinel(cfg, max_connections)
    if not cfg.redis_url:
        raise ValueError("the Redis store needs store.redis_url or store.sentinel")
    if cfg.cluster:
        return _cluster(cfg, cfg.redis_url, max_connections)
    pool = aioredis.BlockingConnectionPool.from_url(
        cfg.redis_url,
        max_connections=max_connections,
        # Wait for a free pooled connection no longer than a call may take.
        timeout=cfg.op_timeout_s,
        **_common(cfg),
    )
    return RedisClient(aioredis.Redis(connection_pool=pool), False, (pool,))


class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's master-following connections from a blocking pool, like the single server's:
    a burst waits (up to the deadline) for a free connection instead of failing at once."""


def _sentinel(cfg: StoreConfig, max_connections: int) -> RedisClient:
    sc = cfg.sentinel
    assert sc is not None
    common = _common(cfg)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": cfg.op_timeout_s,
        "socket_connect_timeout": cfg.op_timeout_s,
        "decode_responses": True,
    }
    if sc.sentinel_password:
        sentinel_kwargs["password"] = sc.sentinel_password
    # Through a typed name: ``Sentinel.__init__`` has no hints up to redis-py 8.1 (the pin; an
    # untyped call under --strict) and has them from 8.2 (where an ignore is reported unused).
    make_sentinel: Callable[..., Sentinel] = Sentinel
    sentinel = make_sentinel(sc.addresses(), sentinel_kwargs=sentinel_kwargs)
    client = sentinel.master_for(
        sc.master,
        connection_pool_class=BlockingSentinelPool,
        max_connections=max_connections,
        timeout=cfg.op_timeout_s,
        db=sc.db,
        password=sc.password,
        # A master whose role check fails is asked for again on every new connection.
        check_connection=False,
        **common,
    )
    return RedisClient(client, False, tuple(sentinel.sentinels))


def _cluster(cfg: StoreConfig, url: str, max_connections: int) -> RedisClient:
    common = _common(cfg)
    client = RedisCluster.from_url(
        url,
        # Slot moves (MOVED/ASK) are followed inside one call; node failures are ours to retry.
        max_connections=max_connections,
        **common,
    )
    return RedisClient(client, True)
