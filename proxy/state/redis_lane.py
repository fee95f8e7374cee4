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

* A connection is reused only after every reply to what was written on it has been read,
  so a late reply can never be read as the answer to a later command. A command cancelled
  by the store's deadline after it was written is *settled*: a task of the lane reads and
  discards its replies (for up to ``SETTLE_S``) and only then puts the connection back. A
  failure, or a cancellation before the command was written whole, closes it.
  Closing it, as the lane did on every cancellation, cost every later call a new
  connection and its handshake (HELLO, CLIENT SETNAME: more round trips, on a loop already
  too slow for the deadline). With Redis paused three times for 0.3 s under 64 connections
  of tiny requests: 484-642 connections made and 7 circuit-breaker openings in a minute
  that way, 84 and 2 settling (docs/redis-schema.md, "Failure behaviour").
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

#: How long a settling connection waits for the replies of a cancelled command before it is
#: closed (a frozen Redis); its slot stays taken meanwhile, so the connections stay bounded.
SETTLE_S = 5.0


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
        self._settling: set[asyncio.Task[None]] = set()

    async def command(self, *args: str | bytes) -> Any:
        """One command, one round trip on a connection of our own; its decoded reply."""
        # hiredis types its argument as a 1-tuple; any length is packed.
        return (await self._send(hiredis.pack_command(args), 1))[0]  # type: ignore[arg-type]

    async def pipeline(self, commands: Sequence[tuple[str, ...]]) -> list[Any]:
        """Several commands in one write and one round trip; their replies in order."""
        packed = b"".join(hiredis.pack_command(c) for c in commands)  # type: ignore[arg-type]
        return await self._send(packed, len(commands))

    async def _send(self, packed: bytes, replies: int) -> list[Any]:
        await self._slots.acquire()
        conn = self._idle.pop() if self._idle else self._pool.connection_class(**self._kwargs)
        clean = settle = False
        written = False
        lost: list[Any] = []
        out: list[Any] = []
        try:
            if not conn.is_connected:
                # The connection's own connect(): a Sentinel connection asks for the
                # master here (send_packed_command's implicit connect would not).
                await conn.connect()
            await conn.send_packed_command(packed, check_health=False)
            written = True
            # A loop, not a comprehension: an ``await`` in one is a coroutine of its own.
            for _ in range(replies):
                # Left open if cancelled here: the replies still due are settled.
                out.append(await conn.read_response(disconnect_on_error=False))
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
            lost = self._take_idle()
            raise
        except asyncio.CancelledError:
            # The deadline, or the caller gone, after the command was written whole: read
            # what is still due in a task, then reuse the connection.
            settle = written and conn.is_connected
            raise
        finally:
            if clean:
                await self._put_back(conn)
            elif settle:
                self._settle(conn, replies - len(out))
            else:
                # Failed, or cancelled mid-handshake or mid-write: out of step, closed.
                await self._drop([*lost, conn])
                self._slots.release()

    async def _put_back(self, conn: Any) -> None:
        if conn.should_reconnect():
            await self._drop([conn])
        else:
            self._idle.append(conn)
        self._slots.release()

    def _settle(self, conn: Any, due: int) -> None:
        """Read and drop ``due`` replies on ``conn`` in a task; then it is idle again."""
        task = asyncio.get_running_loop().create_task(self._settled(conn, due))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settled(self, conn: Any, due: int) -> None:
        try:
            async with asyncio.timeout(SETTLE_S):
                for _ in range(due):
                    with contextlib.suppress(ResponseError):  # a reply, read in full
                        await conn.read_response(disconnect_on_error=False)
        except BaseException as exc:
            # No reply within SETTLE_S (a frozen Redis), a broken connection, or close().
            await self._drop([conn])
            self._slots.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        await self._put_back(conn)

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
        for task in list(self._settling):
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self._drop(self._take_idle())
