"""Real redis-server processes for tests: a shared session fixture and a controllable instance.

``redis_server`` (session scope) starts one server on a free port in a temp dir and yields
its URL. ``RedisInstance`` starts separate servers that fault tests may stop, pause
(SIGSTOP), resume and restart on the same port. A missing redis-server is a test FAILURE,
not a skip: CI installs it (Debian package ``redis-server``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """The redis-server executable, or fail the test with how to get it."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if found is None:
        pytest.fail(
            "redis-server is not installed (not on PATH, not at /usr/bin/redis-server). "
            "The Redis store tests need a real server: install it, e.g. `apt-get install redis-server`.",
            pytrace=False,
        )
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without tearing down."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisInstance:
    """One redis-server process on 127.0.0.1; the port is kept across stop/start."""

    def __init__(self, workdir: Path | None = None, port: int | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="kvroute-redis-")) if workdir is None else workdir
        )
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.workdir / "redis.log", "ab") as log:
            return subprocess.Popen(
                [
                    redis_server_binary(),
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.workdir),
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--loglevel", "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip

    def _launch(self, deadline: float) -> bool:
        """Start the process and wait for PING; False if it exited (port taken) or timed out."""
        self.proc = self._spawn()
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _pings(self.port):
                return True
            time.sleep(0.02)
        self._kill()
        return False

    def _fail(self, what: str) -> None:
        log = self.workdir / "redis.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"redis-server {what} (port {self.port}); log tail:\n{tail}", pytrace=False)

    def start(self) -> RedisInstance:
        """Start on a free port (another one if the port was taken meanwhile)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for _attempt in range(3):
            if self._launch(deadline):
                return self
            self.port = free_port()
        self._fail(f"did not answer PING within {START_TIMEOUT_S}s")
        return self

    def restart(self) -> RedisInstance:
        """Stop and start again on the same port (an empty server: nothing is persisted)."""
        self.stop()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._launch(deadline):
                return self
            time.sleep(0.1)  # the port may be held briefly after the old process exits
        self._fail("did not come back on its port")
        return self

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def stop(self) -> None:
        self._kill()

    def close(self) -> None:
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisInstance:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server for the whole test session; yields its URL (database 0)."""
    instance = RedisInstance(tmp_path_factory.mktemp("redis"))
    instance.start()
    try:
        yield instance.url
    finally:
        instance.close()
