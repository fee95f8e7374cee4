"""Start a child process with its clock shifted by libfaketime, preloaded directly.

Why not the ``faketime`` wrapper: it creates a POSIX semaphore and a shared-memory segment
named after its own pid, refuses to start when they exist already, and removes them only when
it exits normally. A wrapper stopped by a signal (a test stopping a shifted gateway's process
group) leaves both behind, and a later wrapper given the same pid, which comes round quickly
in a CI container, fails with ``sem_open: File exists`` before its child even starts.

The preloaded library (0.9.10) names the same two files after the shifted process's pid, but
opens them whether or not they exist, so a leftover cannot stop it. It never removes them,
even on a normal exit: ``leftovers_removed`` does, once the processes have ended.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

# Where Debian's and a source build's ``faketime`` package put the library.
CANDIDATES = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def library() -> str:
    """The libfaketime shared object, or a clear error saying how to install it."""
    for pattern in CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise RuntimeError("libfaketime.so.1 not found: install it (apt-get install faketime)")


def shifted_env(shift: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the clock shifted by ``shift``,
    in libfaketime's relative form such as ``+10s`` or ``-0.5s``."""
    env = dict(os.environ if base is None else base)
    preload = env.get("LD_PRELOAD")
    env["LD_PRELOAD"] = library() + (f":{preload}" if preload else "")
    env["FAKETIME"] = shift
    return env


def leftovers(pid: int) -> list[str]:
    """The files libfaketime names after ``pid`` under /dev/shm."""
    return [f"/dev/shm/sem.faketime_sem_{pid}", f"/dev/shm/faketime_shm_{pid}"]


@contextlib.contextmanager
def leftovers_removed() -> Iterator[None]:
    """Remove, on the way out, the files shifted processes started inside left under
    /dev/shm (run it around processes that have ended by then)."""
    before = set(glob.glob("/dev/shm/*faketime_s*"))
    try:
        yield
    finally:
        for path in set(glob.glob("/dev/shm/*faketime_s*")) - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
