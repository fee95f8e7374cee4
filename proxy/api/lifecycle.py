"""Startup and shutdown as a list of components, each with a start and a stop.

The gateway wires ~14 parts (store, upstream pool, walk, collector, maintenance, discovery,
reloads...) whose teardown must run in the reverse of their start, and whose start may fail
half way (a Redis that refuses, a Kubernetes API that is away). Written by hand, that order
was kept in two places and a failed start leaked what had already started. Here it is one
list (``proxy.api.wiring.GATEWAY_COMPONENTS``): ``started`` runs each start in order and,
on shutdown or on a start that raises, the stops of those already started, reversed. A stop
that raises is logged and the next one still runs: one part failing to close must not
leave a reservation held or a connection open in the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("kvroute.app")

Parts = TypeVar("Parts")


async def _nothing_to_stop(parts: object) -> None:
    return None


@dataclass(frozen=True)
class Component(Generic[Parts]):
    """One part of the process: ``start`` builds it into ``parts``, ``stop`` takes it down.

    Both take the shared object that holds what earlier components built.
    """

    name: str
    start: Callable[[Parts], Awaitable[None]]
    stop: Callable[[Parts], Awaitable[None]] = _nothing_to_stop


async def stop_all(stops: Sequence[Component[Parts]], parts: Parts) -> None:
    """Each component's stop, in the order given; one that raises does not stop the rest."""
    for component in stops:
        try:
            await component.stop(parts)
        except Exception:
            log.exception("stopping %s failed", component.name)


@contextlib.asynccontextmanager
async def started(components: Sequence[Component[Parts]], parts: Parts) -> AsyncIterator[Parts]:
    """Start ``components`` in order; on exit (or a failed start) stop the started ones, reversed."""
    running: list[Component[Parts]] = []
    try:
        for component in components:
            await component.start(parts)
            running.append(component)
        yield parts
    finally:
        await stop_all(running[::-1], parts)
