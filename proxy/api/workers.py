"""``kvroute serve --workers N``: N gateway processes on one port.

One Python process tops out at about one core (docs/benchmarks.md). Each worker is a whole
``kvroute serve`` of its own, listening with ``SO_REUSEPORT`` on the same address, so the
kernel spreads connections across them; they share nothing but the store. That is why more
than one worker needs Redis: with the embedded store each process would hold its own
reservations and fleet view, and each would overcommit the backends the others fill.

The parent only supervises: it forwards SIGINT/SIGTERM to every worker and, when one exits,
stops the others and exits with its status (a supervisor such as systemd or Kubernetes
restarts the whole set, which keeps "one port, N equal workers" simple to reason about).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

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


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line of one worker: the parent's, with ``--workers`` replaced by ``--reuse-port``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "proxy.cli", *out, "--reuse-port"]


def supervise(argv: Sequence[str], workers: int) -> int:
    """Start ``workers`` copies of this serve command and wait; the first to exit ends them all."""
    procs = [subprocess.Popen(worker_argv(argv)) for _ in range(workers)]
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    rc = 0
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.2)
        first = next(p for p in procs if p.poll() is not None)
        rc = first.returncode if not stopping else 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=35)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return rc
