"""A process's resources as /proc shows them: resident memory, open files, TCP connections.

The soak benchmarks (one gateway, and the fleet under faults) read the same figures; one
copy here keeps them comparable and the two modules out of each other's imports.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

# /proc/net/tcp's state codes for the states a soak watches.
TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def proc_sockets(pid: int) -> tuple[int, set[str]]:
    """Open fds, and the inodes of the sockets among them."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes: set[str] = set()
    n = 0
    for fd in fd_dir.iterdir():
        n += 1
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return n, inodes


def proc_tcp(pid: int, inodes: set[str]) -> Counter[str]:
    """TCP connections owned by the process, by state."""
    states: Counter[str] = Counter()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[9] in inodes:
                states[TCP_STATES.get(parts[3], parts[3])] += 1
    return states
