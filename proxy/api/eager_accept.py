"""Accept every waiting connection at once, not one per turn of a busy event loop.

The libuv that uvloop 0.23 bundles (1.52, what kvroute installs) accepts **one** connection
each time the listening socket is reported readable, that is once per turn of the event
loop. A turn of a loaded
gateway is long: at 150 connections sending 220 KB prompts, reading the bodies and sizing
the prompts made turns of ~0.1 s, so the kernel's accept queue drained at ~10 connections a
second. Measured on this repository's big-prompt benchmark, 60-70 of the 150 connections
opened at the start of a point waited there for up to 2.5 s, their bodies filling the socket
buffer (the client then probes a zero window with back-off): a p99 of ~2 s against a p50 of
~0.15 s, with the same throughput. asyncio's own loop accepts up to the backlog per turn and
has no such tail; neither has vllm-router (docs/lab/big-prompts.md, "The accept queue").

``EagerAccept`` watches a duplicate of the listening socket's descriptor with the loop's own
reader and, each time it is readable, accepts what is waiting (up to ``BATCH``) and hands
each connection to the same protocol factory the server uses. libuv keeps accepting its one
per turn beside it; both take from the same kernel queue. It is closed with the server, so
a drain stops accepting at the same moment (``proxy.api.drain``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("kvroute.app")

#: The most connections accepted in one turn: a flood of connections cannot hold the loop.
BATCH = 256

#: An accept that fails for the listener (out of descriptors or memory, or anything not
#: about one connection): stop accepting this long (asyncio's own pause, 1 s) rather than
#: spin on an error the next accept would meet again. libuv's own accept goes on meanwhile.
RETRY_AFTER_S = 1.0

#: Errors about the one connection being accepted (it left, or the network said no): skip it.
#: Linux's accept(2) asks callers to treat the network errors like EAGAIN.
_CONNECTION_ERRORS = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.EPERM,
        errno.ENETDOWN,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
    }
)


class EagerAccept:
    """Accepts from ``listener`` whenever it is readable; ``close`` stops it for good."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listener: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self.loop = loop
        self.factory = protocol_factory
        # A descriptor of its own: the server's watcher keeps the original (one fd, one watcher).
        self.sock = listener.dup()
        self.sock.setblocking(False)
        self.accepted = 0
        self.closed = False
        self._starting: set[asyncio.Task[object]] = set()
        self._retry: asyncio.TimerHandle | None = None
        loop.add_reader(self.sock.fileno(), self._ready)

    def _ready(self) -> None:
        for _ in range(BATCH):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _CONNECTION_ERRORS:
                    continue
                self._pause(exc)
                return
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.accepted += 1
        task = self.loop.create_task(self._connect(conn))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _connect(self, conn: socket.socket) -> object:
        try:
            return await self.loop.connect_accepted_socket(self.factory, conn)
        except Exception:
            log.debug("an accepted connection could not be started", exc_info=True)
            conn.close()
            return None

    def _pause(self, exc: OSError) -> None:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        log.error("accept failed (%s: %s): not accepting for %gs", name, exc, RETRY_AFTER_S)
        self.loop.remove_reader(self.sock.fileno())
        self._retry = self.loop.call_later(RETRY_AFTER_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._ready)

    def close(self) -> None:
        """Stop accepting (idempotent); connections already accepted are the server's."""
        if self.closed:
            return
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


def accepts_eagerly(sock: socket.socket) -> bool:
    """A listening stream socket (TCP or Unix): what ``EagerAccept`` can serve."""
    return sock.type == socket.SOCK_STREAM and sock.family in (
        socket.AF_INET,
        socket.AF_INET6,
        socket.AF_UNIX,
    )
