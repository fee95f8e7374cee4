"""Ports for child processes (engines, Redis, gateways), chosen outside the ephemeral range.

A port found by binding port 0 comes from the kernel's ephemeral range (32768-60999 on
Linux), the range it also draws from for every outgoing connection on the machine. Between
closing that socket and the child binding the port, any connection (a client, Envoy, a
benchmark's thousands) may take it, and the child dies at start: seen in the test suite
under load, a simulated vLLM engine whose KV-events socket was taken. Ports below the range
are never handed out that way, so only another explicit choice could take one: picked at
random there and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port picked (well above the system and registered services' usual ports).
LOWEST = 20_000
_rng = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _from_the_kernel() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(n: int = 1) -> int:
    """A base port with ``n`` consecutive ports free now (data-parallel ranks, ZeroMQ pairs
    bind base + i), below the ephemeral range."""
    high = ephemeral_low() - n
    if high <= LOWEST:
        # An unusual range leaves no room below it: the kernel's pick, as before.
        return _from_the_kernel()
    for _ in range(200):
        base = _rng.randrange(LOWEST, high)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {LOWEST}-{high + n}")


def free_port() -> int:
    """One port free now, below the ephemeral range (see the module's docstring)."""
    return free_ports(1)
