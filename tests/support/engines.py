"""Start simulated engines for tests: in-process on a background thread, or as a subprocess.

In-process engines (the default) start in milliseconds and run on their own event loop in a
daemon thread, so a test's own loop (pytest-asyncio) and blocking clients both work against
them. Subprocess engines (``python -m loadtest.engine.server``) are for fault tests that kill,
pause (SIGSTOP) or resume the process. Both bind port 0 and report the port they got, so
parallel tests never race for a port.

``engine_factory`` is a pytest fixture that yields ``start(**config) -> handle`` and stops
every engine it started at teardown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import httpx
import pytest

from loadtest.engine.server import Engine, EngineConfig, EngineServer
from loadtest.free_ports import free_ports

START_TIMEOUT_S = 20.0
T = TypeVar("T")

#: What tests get unless they say otherwise: fast simulated time, a modest cache.
TEST_DEFAULTS: dict[str, Any] = {"speedup": 1000.0, "capacity_tokens": 100_000}


def free_port() -> int:
    """A port that was free a moment ago (prefer port 0 where the server can report its port),
    below the ephemeral range, where no outgoing connection takes it meanwhile."""
    return free_ports(1)


class EngineHandle(Protocol):
    name: str
    config: EngineConfig

    @property
    def url(self) -> str: ...
    @property
    def port(self) -> int: ...
    def stop(self) -> None: ...


_HTTP: httpx.Client | None = None


def _client() -> httpx.Client:
    """One shared client: creating an httpx client costs tens of milliseconds (TLS context)."""
    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.Client(timeout=10)
    return _HTTP


def _admin(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    c = _client()
    r = c.post(url + path, json=body) if body is not None else c.get(url + path)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


class _AdminMixin:
    """Shortcuts over the engine's HTTP admin endpoints (work for both kinds of handle)."""

    url: str

    def state(self) -> dict[str, Any]:
        return _admin(self.url, "/admin/state?gaps=1")

    def restart(self) -> dict[str, Any]:
        return _admin(self.url, "/admin/restart", {})

    def fault(self, mode: str, scope: str = "inference") -> dict[str, Any]:
        return _admin(self.url, "/admin/fault", {"mode": mode, "scope": scope})

    def hold(self, tokens: int, count: int = 1) -> list[str]:
        """Pin ``count`` regions of ``tokens`` (in address order on a fresh contiguous engine)."""
        return [
            h["id"]
            for h in _admin(self.url, "/admin/hold", {"tokens": tokens, "count": count})["held"]
        ]

    def release(self, ids: list[str]) -> dict[str, Any]:
        return _admin(self.url, "/admin/release", {"ids": ids})

    def fragment(self, hole_tokens: int, holes: int | None = None) -> dict[str, Any]:
        """Checkerboard the cache: alternate held and free regions of ``hole_tokens``.

        Afterwards about half the cache is free but no request above ``hole_tokens`` fits
        (the problem's false capacity exhaustion). ``holes`` limits how many regions are freed.
        """
        cap = int(self.state()["capacity_tokens"])
        ids = self.hold(hole_tokens, cap // hole_tokens)
        freed = ids[0::2] if holes is None else ids[0::2][:holes]
        self.release(freed)
        return self.state()


class ThreadEngine(_AdminMixin):
    """An engine served from a daemon thread with its own event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.name = config.name
        self._server = EngineServer(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._port = 0

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://{self.config.host}:{self._port}"

    @property
    def engine(self) -> Engine:
        """The live engine object: read figures freely; mutate only through :meth:`call`."""
        return self._server.engine

    def start(self) -> ThreadEngine:
        self._thread = threading.Thread(target=self._main, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"engine {self.name} did not start within {START_TIMEOUT_S}s")
        if self._error is not None:
            raise RuntimeError(f"engine {self.name} failed to start") from self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._stopped = asyncio.Event()
            self._port = loop.run_until_complete(self._server.start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_until_complete(self._stopped.wait())
            loop.run_until_complete(self._server.stop())
        finally:
            loop.close()

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine's own loop and return its result."""
        assert self._loop is not None
        fut: Future[T] = Future()

        def _run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(_run)
        return fut.result(timeout=10)

    def stop(self) -> None:
        if self._loop is None or self._thread is None or self._stopped is None:
            return
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(15)
        self._thread = None


class ProcessEngine(_AdminMixin):
    """An engine in its own process (``python -m loadtest.engine.server``), for fault tests."""

    def __init__(self, config: EngineConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.name = config.name
        self.popen: subprocess.Popen[str] | None = None
        self._port = 0
        self.log_path = (
            log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        ) / f"kvroute-engine-{self.name}-{os.getpid()}-{id(self)}.log"

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:  # type: ignore[override]
        return f"http://{self.config.host}:{self._port}"

    def argv(self) -> list[str]:
        c = self.config
        argv = [
            sys.executable, "-m", "loadtest.engine.server",
            "--host", c.host, "--port", str(c.port), "--name", c.name, "--model", c.model,
            "--allocator", c.allocator, "--capacity-tokens", str(c.capacity_tokens),
            "--block-size", str(c.block_size), "--prefill-tokens-per-s", str(c.prefill_tokens_per_s),
            "--decode-tokens-per-s", str(c.decode_tokens_per_s), "--speedup", str(c.speedup),
            "--default-max-tokens", str(c.default_max_tokens), "--seed", str(c.seed),
            "--chunk-interval-s", str(c.chunk_interval_s),
        ]  # fmt: skip
        if c.strict_model:
            argv.append("--strict-model")
        if not c.uvloop:
            argv.append("--no-uvloop")
        return argv

    def start(self) -> ProcessEngine:
        log = self.log_path.open("w")
        self.popen = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        log.close()
        line = self._read_ready_line()
        self._port = int(line.rsplit(":", 1)[1])
        # Keep draining stdout so the engine can never block on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _read_ready_line(self) -> str:
        assert self.popen is not None and self.popen.stdout is not None
        stdout = self.popen.stdout
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        line = result[0].strip() if result else ""
        if "listening on http://" not in line:
            self.stop()
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise RuntimeError(f"engine process {self.name} did not start: {line!r}\n{log[-2000:]}")
        return line

    def _drain(self) -> None:
        p = self.popen
        if p is not None and p.stdout is not None:
            for _ in p.stdout:
                pass

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections are accepted by the kernel, nothing answers."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """Die at once (SIGKILL), as a crashed engine does."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(10)

    def stop(self) -> None:
        p = self.popen
        if p is None:
            return
        if p.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
        self.popen = None


Mode = Literal["thread", "process"]


def start_engine(mode: Mode = "thread", **config: Any) -> ThreadEngine | ProcessEngine:
    """Start one engine; ``config`` are EngineConfig fields over TEST_DEFAULTS (port 0 = any)."""
    cfg = EngineConfig(**{**TEST_DEFAULTS, "port": 0, **config})
    if mode == "thread":
        return ThreadEngine(cfg).start()
    if mode == "process":
        return ProcessEngine(cfg).start()
    raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Any]]:
    """``start(mode="thread"|"process", **EngineConfig fields)``; names default to engine-1, engine-2, ..."""
    started: list[ThreadEngine | ProcessEngine] = []

    def start(mode: Mode = "thread", **config: Any) -> Any:
        config.setdefault("name", f"engine-{len(started) + 1}")
        handle = start_engine(mode, **config)
        started.append(handle)
        return handle

    yield start
    for h in reversed(started):
        h.stop()


__all__ = [
    "TEST_DEFAULTS",
    "EngineHandle",
    "ProcessEngine",
    "ThreadEngine",
    "engine_factory",
    "free_port",
    "start_engine",
    "wait_until",
]
