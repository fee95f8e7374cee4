"""``EagerAccept``: every connection waiting in the accept queue is taken in one turn of the loop.

Real sockets on 127.0.0.1 and the loop kvroute serves on (uvloop), whose libuv accepts one
connection per turn (``proxy.api.eager_accept``). Clients connect before the loop turns:
the kernel completes their handshakes into the listening socket's queue, as it does for
clients that connect while a loaded gateway is busy.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest
import uvloop

from proxy.api import eager_accept
from proxy.api.app import create_app
from proxy.api.drain import DrainingServer
from proxy.api.eager_accept import EagerAccept, accepts_eagerly
from proxy.api.server import server_config
from tests.support.gateway import gateway_cfg, wait_until

CLIENTS = 40


class Counted(asyncio.Protocol):
    made: ClassVar[list[Counted]]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made.append(self)


def counted() -> type[Counted]:
    class Each(Counted):
        made: ClassVar[list[Counted]] = []

    return Each


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    sock.setblocking(False)
    yield sock
    sock.close()


def connect_clients(sock: socket.socket, n: int) -> list[socket.socket]:
    clients = []
    for _ in range(n):
        c = socket.create_connection(sock.getsockname(), timeout=5)
        clients.append(c)
    return clients


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro_fn: object) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro_fn())  # type: ignore[operator]


def test_every_waiting_connection_is_taken_within_two_turns(listener: socket.socket) -> None:
    proto = counted()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(proto, sock=listener)
        clients = connect_clients(listener, CLIENTS)
        acceptor = EagerAccept(loop, listener, proto)
        await turns(3)
        assert len(proto.made) == CLIENTS, f"{len(proto.made)} of {CLIENTS} connections started"
        assert acceptor.accepted >= CLIENTS - 3  # libuv's own watcher takes one a turn
        acceptor.close()
        server.close()
        for c in clients:
            c.close()

    run(main)


def test_the_loop_alone_takes_one_connection_a_turn(listener: socket.socket) -> None:
    """The premise: without ``EagerAccept`` the same clients wait (uvloop's libuv 1.5x)."""
    proto = counted()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(proto, sock=listener)
        clients = connect_clients(listener, CLIENTS)
        await turns(3)
        taken = len(proto.made)
        server.close()
        for c in clients:
            c.close()
        assert taken < CLIENTS / 2, f"the loop took {taken} of {CLIENTS} in 3 turns"

    run(main)


def test_the_connections_it_accepts_carry_data_both_ways(listener: socket.socket) -> None:
    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]

        def data_received(self, data: bytes) -> None:
            self.transport.write(data.upper())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        acceptor = EagerAccept(loop, listener, Echo)
        reader, writer = await asyncio.open_connection(*listener.getsockname())
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"HELLO"
        writer.close()
        acceptor.close()

    run(main)


def test_after_close_nothing_more_is_accepted_and_its_descriptor_is_gone(
    listener: socket.socket,
) -> None:
    proto = counted()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        acceptor = EagerAccept(loop, listener, proto)
        first = connect_clients(listener, 2)
        await turns(3)
        assert len(proto.made) == 2
        acceptor.close()
        acceptor.close()  # idempotent
        later = connect_clients(listener, 2)
        await turns(3)
        assert len(proto.made) == 2 and acceptor.accepted == 2
        assert acceptor.sock.fileno() == -1
        for c in first + later:
            c.close()

    run(main)


class FailsOnce:
    """The acceptor's socket, whose first ``accept`` raises ``error`` (then the real one's)."""

    def __init__(self, real: socket.socket, error: int) -> None:
        self.real = real
        self.failures = [OSError(error, os.strerror(error))]

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            raise self.failures.pop()
        return self.real.accept()


async def accept_after_a_failure(
    listener: socket.socket, proto: type[Counted], error: int, wait_s: float
) -> tuple[bool, int, int]:
    """Three clients behind an accept that fails with ``error``: (paused, started after three
    turns, started ``wait_s`` later)."""
    loop = asyncio.get_running_loop()
    acceptor = EagerAccept(loop, listener, proto)
    real = acceptor.sock
    acceptor.sock = FailsOnce(real, error)  # type: ignore[assignment]
    clients = connect_clients(listener, 3)
    await turns(3)
    paused, early = acceptor._retry is not None, len(proto.made)
    await asyncio.sleep(wait_s)
    acceptor.sock = real
    acceptor.close()
    for c in clients:
        c.close()
    return paused, early, len(proto.made)


def test_out_of_descriptors_pauses_accepting_then_resumes(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eager_accept, "RETRY_AFTER_S", 0.05)
    proto = counted()
    result: list[tuple[bool, int, int]] = []

    async def main() -> None:
        result.append(await accept_after_a_failure(listener, proto, errno.EMFILE, 0.2))

    run(main)
    # Paused: no spin on the error, the connections wait in the queue; then all are taken.
    assert result == [(True, 0, 3)]


@pytest.mark.parametrize(
    ("error", "paused"),
    [(errno.ECONNABORTED, False), (errno.EPROTO, False), (errno.EINVAL, True)],
)
def test_an_error_about_one_connection_skips_it_and_any_other_pauses(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch, error: int, paused: bool
) -> None:
    monkeypatch.setattr(eager_accept, "RETRY_AFTER_S", 30.0)
    proto = counted()
    result: list[tuple[bool, int, int]] = []

    async def main() -> None:
        result.append(await accept_after_a_failure(listener, proto, error, 0.0))

    run(main)
    # Skipped: the connections behind it are taken at once. Paused: none for 30 s.
    taken = 0 if paused else 3
    assert result == [(paused, taken, taken)]


def test_it_serves_stream_sockets_only() -> None:
    tcp, udp = socket.socket(), socket.socket(type=socket.SOCK_DGRAM)
    unix = socket.socket(socket.AF_UNIX)
    try:
        assert accepts_eagerly(tcp) and accepts_eagerly(unix) and not accepts_eagerly(udp)
    finally:
        for s in (tcp, udp, unix):
            s.close()


class ThreadedDrainingServer(DrainingServer):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


def test_kvroute_server_accepts_eagerly_and_answers_on_those_connections(
    listener: socket.socket,
) -> None:
    """The server ``kvroute serve`` runs: its acceptor takes the connections that queued while
    its loop was busy, and each one is served (a ``GET /ready``) like any other."""
    cfg = gateway_cfg([{"name": "b0", "url": "http://127.0.0.1:9", "pool": "general"}])
    app = create_app(cfg, run_collector=False)
    port = listener.getsockname()[1]
    server = ThreadedDrainingServer(
        server_config(app, cfg, "127.0.0.1", port, log_level="warning", loop="uvloop"),
        app.state.drain,
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="server started")
    try:
        (acceptor,) = server.acceptors
        # Busy for a moment, as a loaded gateway is: the clients queue in the kernel meanwhile.
        acceptor.loop.call_soon_threadsafe(time.sleep, 0.5)
        clients = connect_clients(listener, CLIENTS)
        wait_until(lambda: acceptor.accepted >= CLIENTS - 3, what="acceptor took the queue")
        for c in clients:
            c.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        for c in clients:
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            c.close()
    finally:
        server.should_exit = True
        thread.join(15)
    assert acceptor.closed and acceptor.sock.fileno() == -1
