"""Redis calls that walk slots or nodes: the Cluster's per-slot fleet read, and SCAN.

Kept apart from redis_store.py, which issues the per-backend calls; these two take the
store's client and its deadline wrapper (``call``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.crc import key_slot

from proxy.state.redis_codec import RedisKeys
from proxy.state.redis_scripts import LUA_READ

Call = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


async def read_per_slot(
    client: Any, keys_of: RedisKeys, call: Call, names: list[str]
) -> tuple[list[str], list[Any]]:
    """Cluster: one read script per hash slot, pipelined (one batch per node).

    Returns the names in reply order with the flat per-key replies, like the single call.
    """
    by_slot: dict[int, list[str]] = {}
    for n in names:
        by_slot.setdefault(key_slot(keys_of.state(n).encode()), []).append(n)
    groups = list(by_slot.values())

    async def op() -> list[Any]:
        async with client.pipeline() as pipe:
            for group in groups:
                keys = [k for n in group for k in keys_of.backend_hashes(n)]
                pipe.eval(LUA_READ, len(keys), *keys)
            return cast(list[Any], await pipe.execute())

    replies = await call("read", op)
    return [n for g in groups for n in g], [r for reply in replies for r in reply]


async def scan_keys(client: Any, call: Call, cluster: bool, pattern: str) -> list[str]:
    """Every key matching ``pattern``; each SCAN page under its own deadline, every primary."""
    found: list[str] = []
    nodes: list[Any] = client.get_primaries() if cluster else [None]
    for node in nodes:
        target = {} if node is None else {"target_nodes": node}
        cursor: int = 0
        while True:
            reply = await call(
                "known_backends",
                lambda c=cursor, t=target: client.scan(c, match=pattern, count=1000, **t),  # type: ignore[misc]
            )
            if cluster:
                # redis-py answers a cluster SCAN as ({node name: cursor}, keys).
                cursors, keys = reply
                cursor = int(next(iter(cursors.values()), 0))
            else:
                cursor, keys = reply
            found.extend(cast(list[str], keys))
            if int(cursor) == 0:
                break
    return found
