"""``kvroute serve --workers N``: N gateway processes on one port.

One Python process tops out at about one core (docs/benchmarks.md). Each worker is a whole
``kvroute serve`` of its own, listening with ``SO_REUSEPORT`` on the same address, so the
kernel spreads connections across them; they share nothing but the store. That is why more
than one worker needs Redis: with the embedded store each process would hold its own
reservations and fleet view, and each would overcommit the backends the others fill.

The parent only supervises: it forwards SIGINT/SIGTERM to every worker. A worker killed by
a signal (the OOM killer, a stray SIGKILL) is started again in its place: it comes back as a
new replica with a new lease, and what the killed one had reserved stops counting when its
lease lapses (``store.lease_ttl_s``, proxy.state.lease). More than ``MAX_RESTARTS`` such
deaths within ``RESTART_WINDOW_S`` is a crash loop: the set stops. A worker that exits by
itself (a config error at start, a clean exit) stops the others and the parent exits with
its status, as before (a supervisor such as systemd or Kubernetes restarts the whole set).
SIGHUP means what it means to one process (proxy.api.hangup): reload, passed on to every
worker, or stop. Each worker also listens on a Unix socket in a private directory, so a
``POST /admin/reload`` taken by one worker reaches the others (proxy.api.worker_peers).
Stopping waits for the workers' drain (``shutdown.drain_s``) before it kills anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import FrameType

from proxy.api.drain import CLOSE_GRACE_S
from proxy.api.hangup import RELOAD_FLAG, STOP_FLAG, hup_flag
from proxy.api.worker_peers import WORKER_DIR_ENV
from proxy.config import Config

EMBEDDED_STORE_REFUSAL = (
    "--workers {n}: more than one worker needs a shared store; with the embedded store each "
    "worker would reserve on its own and overcommit the backends. Configure Redis "
    "(store.redis_url or store.sentinel, or KVROUTE_REDIS_URL), or run --workers 1."
)


def refusal(cfg: Config, workers: int) -> str | None:
    """Why ``workers`` processes cannot serve this config, or None when they can."""
    if workers < 1:
        return f"--workers {workers}: at least one worker is needed"
    if workers > 1 and not cfg.store.uses_redis:
        return EMBEDDED_STORE_REFUSAL.format(n=workers)
    return None


def worker_argv(argv: Sequence[str], reloads: bool) -> list[str]:
    """The command line of one worker: the parent's, with ``--workers`` replaced by
    ``--reuse-port`` and SIGHUP's meaning stated (a worker must not guess it again)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers=") or arg in (RELOAD_FLAG, STOP_FLAG):
            continue
        out.append(arg)
    return [sys.executable, "-m", "proxy.cli", *out, "--reuse-port", hup_flag(reloads)]


def sockets_directory() -> str:
    """A private directory for the workers' sockets: under TMPDIR, or /tmp when TMPDIR is too
    long for a Unix socket's path (108 bytes on Linux, the name included)."""
    found = tempfile.mkdtemp(prefix="kvroute-workers-")
    if len(found) + len("/worker-4194304.sock") < 100:
        return found
    os.rmdir(found)
    return tempfile.mkdtemp(prefix="kvroute-workers-", dir="/tmp")


#: Workers killed by a signal are restarted, at most this many within the window.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class Restarts:
    """The restart budget: a worker killed by a signal is restarted unless deaths crowd."""

    def __init__(self, limit: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self.at: deque[float] = deque()

    def allow(self, returncode: int, now: float) -> bool:
        """Restart a worker that ended with ``returncode``? Only one killed by a signal."""
        if returncode >= 0:
            return False
        while self.at and now - self.at[0] > self.window_s:
            self.at.popleft()
        if len(self.at) >= self.limit:
            return False
        self.at.append(now)
        return True


def _watch(
    procs: list[subprocess.Popen[bytes]],
    start: Callable[[], subprocess.Popen[bytes]],
    stopping: Callable[[], bool],
    restarts: Restarts,
) -> int:
    """Wait until a worker ends for good; restart those killed by a signal meanwhile.

    Returns the status of the one that ended the set."""
    while True:
        time.sleep(0.2)
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                continue
            if stopping() or not restarts.allow(rc, time.monotonic()):
                return rc
            procs[i] = start()
            print(
                f"kvroute: worker {p.pid} killed by signal {-rc}; restarted as {procs[i].pid} "
                "(its reservations stop counting when its lease lapses)",
                file=sys.stderr,
                flush=True,
            )


def supervise(argv: Sequence[str], workers: int, reloads: bool, drain_s: float) -> int:
    """Start ``workers`` copies of this serve command; restart any killed by a signal; the
    first to exit by itself (or a crash loop) ends them all."""
    sockets_dir = sockets_directory()
    env = {**os.environ, WORKER_DIR_ENV: sockets_dir}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(worker_argv(argv, reloads), env=env)

    procs = [start() for _ in range(workers)]
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if signum == signal.SIGHUP and not reloads:
            # A hangup that stops: the workers drain as on SIGTERM.
            signum = signal.SIGTERM
        stopping = stopping or signum != signal.SIGHUP
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = 0
    try:
        rc = _watch(procs, start, lambda: stopping, Restarts())
        rc = rc if not stopping else 0
    finally:
        _stop_all(procs, drain_s + CLOSE_GRACE_S + 10)
        shutil.rmtree(sockets_dir, ignore_errors=True)
    return rc


def _stop_all(procs: list[subprocess.Popen[bytes]], wait_s: float) -> None:
    """SIGTERM what still runs, wait out its drain, kill only what outlives it."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
