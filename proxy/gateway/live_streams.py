"""The streams being relayed right now, so a stopping gateway can end them properly.

A shutdown lets in-flight streams run for ``shutdown.drain_s`` (proxy.api.drain). One still
running then must not just lose its connection: the client could not tell a gateway restart
from a broken backend. ``interrupt_all`` asks each relay to stop reading and end its stream
with a final SSE error event (code ``gateway_shutting_down``) while the server still writes.
"""

from __future__ import annotations

from typing import Protocol


class Interruptible(Protocol):
    def interrupt(self) -> None:
        """Stop relaying soon and end the stream with the shutdown error event."""


class LiveStreams:
    """A set of relays; registering and leaving are O(1) (one per stream, on the hot path)."""

    __slots__ = ("_relays",)

    def __init__(self) -> None:
        self._relays: set[Interruptible] = set()

    def add(self, relay: Interruptible) -> None:
        self._relays.add(relay)

    def discard(self, relay: Interruptible) -> None:
        self._relays.discard(relay)

    def __len__(self) -> int:
        return len(self._relays)

    def interrupt_all(self) -> int:
        """Interrupt every live stream; returns how many there were."""
        relays = list(self._relays)
        for relay in relays:
            relay.interrupt()
        return len(relays)
