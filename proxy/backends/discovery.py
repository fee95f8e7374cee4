"""Backend discovery: the backend list follows the fleet instead of a static config.

``discovery.type`` picks the source: ``static`` (the config's ``backends``, the default),
``kubernetes`` (EndpointSlices of the inference Services, ``discovery_kubernetes``),
``inferencepool`` (the pods of an InferencePool, ``discovery_inferencepool``) or ``dns`` (A
or SRV records of a headless Service, ``discovery_dns``). A source publishes a
whole list each time something changes; ``Discovery`` keeps the latest, calls
``on_change`` only when the list really differs, and the app wiring hands the new list to
the collector, the health checks, the fleet cache and maintenance. Static ``backends`` are
always kept alongside discovered ones (a name clash keeps the static entry).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable

from proxy.config import BackendConfig, DiscoveryConfig
from proxy.config.base import ServingRole
from proxy.tasks import stop_task

log = logging.getLogger("kvroute.discovery")

ChangeHook = Callable[[list[BackendConfig]], None]
# Retry delays after a failed list/watch/resolve: fast at first, capped.
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
FIRST_LIST_TIMEOUT_S = 10.0
# How long a stop waits for the loop before leaving it behind (logged), as PeriodicTask does.
STOP_TIMEOUT_S = 5.0


class Discovery(abc.ABC):
    """A source of backends with a background loop; ``backends`` is the latest list."""

    def __init__(self, cfg: DiscoveryConfig, static: list[BackendConfig]) -> None:
        self.cfg = cfg
        self.static = list(static)
        self.backends: list[BackendConfig] = list(static)
        self.on_change: list[ChangeHook] = []
        self.updates = 0
        self._task: asyncio.Task[None] | None = None
        # Ends the loop at its next turn even if a library swallowed the cancellation.
        self._stopping = False

    @abc.abstractmethod
    async def _run(self) -> None:
        """Follow the source until cancelled, calling ``publish`` with each full list."""

    @abc.abstractmethod
    async def first_list(self) -> None:
        """One fetch before serving, so the first snapshot has backends; failures are logged."""

    def _merge(self, found: list[BackendConfig]) -> list[BackendConfig]:
        names = {b.name for b in self.static}
        return self.static + sorted((b for b in found if b.name not in names), key=lambda b: b.name)

    def publish_quietly(self, found: list[BackendConfig]) -> None:
        """Take a new list without calling ``on_change`` (a config reload applies it itself)."""
        self.backends = self._merge(found)

    def publish(self, found: list[BackendConfig]) -> None:
        merged = self._merge(found)
        if merged == self.backends:
            return
        added = {b.name for b in merged} - {b.name for b in self.backends}
        removed = {b.name for b in self.backends} - {b.name for b in merged}
        log.info(
            "backends changed: %d now (+%s -%s)",
            len(merged),
            ",".join(sorted(added)) or "none",
            ",".join(sorted(removed)) or "none",
        )
        self.backends = merged
        self.updates += 1
        for hook in self.on_change:
            hook(list(merged))

    async def start(self) -> None:
        try:
            async with asyncio.timeout(FIRST_LIST_TIMEOUT_S):
                await self.first_list()
        except Exception as exc:  # the loop keeps trying; the gateway starts regardless
            log.warning("discovery: first list failed (%s); retrying in the background", exc)
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name="kvroute-discovery"
            )

    async def _loop(self) -> None:
        delay = BACKOFF_START_S
        while not self._stopping:
            try:
                await self._run()
                delay = BACKOFF_START_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("discovery: %s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2.0, BACKOFF_MAX_S)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            await stop_task(task, "kvroute-discovery", STOP_TIMEOUT_S)
        await self.close()

    async def close(self) -> None:
        return None


def backend(
    cfg: DiscoveryConfig,
    name: str,
    host: str,
    port: int,
    pool: str | None = None,
    role: ServingRole = "both",
) -> BackendConfig:
    """A discovered backend with the discovery section's kind, pool and capacity settings."""
    shown = f"[{host}]" if ":" in host else host
    return BackendConfig(
        name=name[:64],
        url=f"http://{shown}:{port}",  # type: ignore[arg-type]  # pydantic parses the URL
        pool=pool or cfg.pool,
        kind=cfg.kind,
        capacity_tokens=cfg.capacity_tokens,
        role=role,
        data_parallel_routing=cfg.data_parallel_routing,
        kv_events=cfg.kv_events,
    )
