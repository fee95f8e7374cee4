"""Child processes that never outlive the run that started them, and why one failed to start.

``kvroute local-fleet``, the demo, the benchmarks and the tests start engines, Redis and
gateways as real processes. Each runs in its own session (so a Ctrl-C in the terminal reaches
only the parent, which stops them in order), which also means a hangup or a SIGKILL of the
parent would leave them running with parent PID 1, holding their ports: the next start then
says "port in use". On Linux each child asks the kernel for ``PR_SET_PDEATHSIG``: when the
parent dies, for any reason, the child is killed too.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process: a
child started from a worker thread would die with that thread. So it is requested only for
children started from the main thread; the others rely on the parent's own ``stop()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

# linux/prctl.h
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent (nothing to look up after fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn: Callable[..., int] = libc.prctl
    return fn


_PRCTL = _load_prctl()


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that kills the child when this process dies (None where unsupported).

    The child checks its parent after the request: if the parent died between ``fork`` and
    ``prctl`` the signal would never come, so it exits at once instead.
    """
    prctl = _PRCTL
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return hook


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port`` (e.g. an engine left from a run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def log_tail(path: Path | None, lines: int = 8) -> str:
    """The last lines of a child's log: where the real cause of a failed start is written."""
    if path is None:
        return ""
    with contextlib.suppress(OSError):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        return "\n".join(text.splitlines()[-lines:])
    return ""


def stop_processes(procs: Iterable[subprocess.Popen[str]], grace_s: float = 10.0) -> None:
    """Stop ``procs`` in reverse start order: SIGTERM, then SIGKILL after ``grace_s``; close
    the pipes they wrote to."""
    for proc in reversed(list(procs)):
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
        if proc.stdout is not None:
            proc.stdout.close()
