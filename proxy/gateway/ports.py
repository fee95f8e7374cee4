"""What the steps of a request's walk may use of the gateway: their ports.

A step never takes the whole ``Gateway`` (``proxy.gateway.walk``): it takes a small
``Protocol`` naming the parts it uses, declared next to it (``DivertPorts`` in ``divert``,
``PlacementPorts`` in ``placement``...), built on the one shared here. The ``Gateway`` fits
every one of them structurally, so the protocols cost nothing at run time (no adapter
object, no extra call per request) while a step's signature says what it can touch, and no
step imports ``walk`` (the import circle the gateway package once was).

The config is never a port: a step reads the config the request started with
(``ctx.cfg``), never the live one a reload may have replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from proxy.gateway.background import Background
from proxy.gateway.metrics import GatewayMetrics
from proxy.upstream.health import BackendHealth


class SharedPorts(Protocol):
    """What almost every step uses: the metrics sink, backend health, the clock, the task helper."""

    metrics: GatewayMetrics
    health: BackendHealth
    # Wall clock (seconds): reservation times and TTLs as the store keeps them.
    clock: Callable[[], float]
    # Background work (releases, store bookkeeping) and guarded store calls.
    tasks: Background
