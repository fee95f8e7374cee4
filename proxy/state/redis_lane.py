"""The request path's two Redis commands (reserve's EVALSHA, release's HDEL), sent lean.

Profiled under load (issue 12): redis-py 8's ``execute_command`` wraps every command in a
retry object, observability hooks, the blocking pool's condition variable and timeout, a
``can_read`` check of the socket on every checkout and the ``Script`` wrapper; that was
most of the Redis store's CPU per request. This lane keeps its own small set of idle
connections (made with the client pool's own connection class and settings, so the same
address, Sentinel master lookup and auth apply) and only packs, writes and reads. Its
callers' deadline (``RedisStore._call``) is the only timeout: the connections have no
socket timeout of their own.

What must stay true (the store's fault guarantees rest on it):

* A connection is reused only after a command on it completed cleanly; any failure or
  cancellation (the store's deadline) while a command is in flight closes it, so a late
  reply can never be read as the answer to a later command.
* Connections in use are bounded (``max_connections``); a burst waits for a free one, and
  that wait is under the caller's deadline like everything else.
* Errors are redis-py's own (ConnectionError, TimeoutError, ResponseError), so
  ``RedisStore._call`` classifies them exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class RedisLane:
    """Lean EVALSHA/HDEL over connections made by ``pool`` (redis-py single or Sentinel pool)."""

    def __init__(self, pool: Any, max_connections: int) -> None:
        self._pool = pool
        # No socket timeout of the connection's own: redis-py enforces it with a wait_for
        # (a task) per write and a timeout context per read. Every lane call runs under
        # RedisStore._call's deadline, which bounds the whole call instead.
        self._kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        self._idle: list[Any] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def command(self, *args: str | bytes) -> Any:
        """One command, one round trip on a connection of our own; its decoded reply."""
        # hiredis types its argument as a 1-tuple; any length is packed.
        return (await self._send(hiredis.pack_command(args), 1))[0]  # type: ignore[arg-type]

    async def pipeline(self, commands: Sequence[tuple[str, ...]]) -> list[Any]:
        """Several commands in one write and one round trip; their replies in order."""
        packed = b"".join(hiredis.pack_command(c) for c in commands)  # type: ignore[arg-type]
        return await self._send(packed, len(commands))

    async def _send(self, packed: bytes, replies: int) -> list[Any]:
        async with self._slots:
            conn = self._idle.pop() if self._idle else self._pool.connection_class(**self._kwargs)
            clean = False
            try:
                if not conn.is_connected:
                    # The connection's own connect(): a Sentinel connection asks for the
                    # master here (send_packed_command's implicit connect would not).
                    await conn.connect()
                await conn.send_packed_command(packed, check_health=False)
                # A loop, not a comprehension: an ``await`` in one is a coroutine of its own.
                out = []
                for _ in range(replies):
                    out.append(await conn.read_response())
                clean = True
                return out
            except ResponseError:
                # A reply was read in full (NOSCRIPT, WRONGTYPE...): the connection is in step.
                clean = True
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # The server died or was demoted: the idle connections are likely to the same
                # server, and the store's one retry must get a fresh one. (Not on a mere
                # cancellation: a client hanging up says nothing about Redis.)
                await self._drop(self._take_idle())
                raise
            finally:
                if clean and not conn.should_reconnect():
                    self._idle.append(conn)
                else:
                    # In flight when it failed or was cancelled: its reply may still come.
                    await self._drop([conn])

    def _take_idle(self) -> list[Any]:
        idle, self._idle = self._idle, []
        return idle

    @staticmethod
    async def _drop(conns: list[Any]) -> None:
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)

    async def evalsha(self, sha: str, script: str, keys: list[str], args: list[str]) -> Any:
        """EVALSHA; after a Redis restart (NOSCRIPT) the script is loaded and run once more."""
        # ``command``, inlined: one coroutine less on every request's reserve.
        packed = hiredis.pack_command(("EVALSHA", sha, str(len(keys)), *keys, *args))  # type: ignore[arg-type]
        try:
            return (await self._send(packed, 1))[0]
        except NoScriptError:
            await self.command("SCRIPT", "LOAD", script)
            return await self.command("EVALSHA", sha, str(len(keys)), *keys, *args)

    async def close(self) -> None:
        await self._drop(self._take_idle())
