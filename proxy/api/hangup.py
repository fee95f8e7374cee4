"""What SIGHUP means to ``kvroute serve``: "the terminal is gone" or "reload the config".

Both meanings are conventional, and they conflict. A program in the foreground of a
terminal gets SIGHUP when the terminal closes (ssh drops, the window is closed), and is
expected to stop, as every child of that terminal does; a daemon under a supervisor has no
terminal, and nginx, HAProxy and Prometheus taught operators that ``kill -HUP`` reloads it.

kvroute chooses by where it runs, and lets the operator say so explicitly:

* ``--reload-on-hup``: SIGHUP reloads (the image's default command and the manifests pass it);
* ``--stop-on-hup``: SIGHUP stops, with the same drain as SIGTERM;
* neither: SIGHUP stops when stdin, stdout or stderr is a terminal (an interactive run),
  and reloads otherwise (systemd, Kubernetes, ``nohup``, a pipe to a log collector).

``POST /admin/reload`` reloads in either mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

RELOAD_FLAG = "--reload-on-hup"
STOP_FLAG = "--stop-on-hup"


def attached_to_terminal(fds: Sequence[int] = (0, 1, 2)) -> bool:
    """True when any of ``fds`` is a terminal (a closed descriptor counts as none)."""
    for fd in fds:
        try:
            if os.isatty(fd):
                return True
        except OSError:
            continue
    return False


def hup_reloads(choice: bool | None) -> bool:
    """The decision: ``choice`` (from the flags) when given, else reload unless on a terminal."""
    if choice is not None:
        return choice
    return not attached_to_terminal()


def hup_flag(reloads: bool) -> str:
    """The command-line flag that states a decision (the supervisor hands it to its workers)."""
    return RELOAD_FLAG if reloads else STOP_FLAG
