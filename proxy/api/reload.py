"""Hot reload: re-read the config file, validate it fully, swap it in one step.

Operators change backends, pools, thresholds and weights without dropping traffic. A reload
(``SIGHUP`` or ``POST /admin/reload``) reads the file the gateway was started with (plus the
same ``KVROUTE_*`` environment overrides), validates all of it with the same model as a
start, and only then hands the new, frozen ``Config`` to every part that reads it, in one
synchronous step on the event loop: no request can see half of a reload. An invalid file
changes nothing; it is reported in the log, in the reload response and as
``kvroute_config_reload_total{result="invalid"}``.

Config objects are immutable, so a request that took its config before the swap finishes on
that config. A backend that left the file is drained, not cut: it is no longer offered to new
requests, while requests already on it finish on their open connection and release their
reservation as usual. Keys that name resources opened at start (``listen``, ``store``,
``upstream.max_connections``, ``queue.max_size``, ``discovery``) are reported as needing a
restart; the rest take effect at once. Discovery's backend changes go through the same
holder, so a reload and a discovered change never undo each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from proxy.config import Config, ConfigError, load_config

log = logging.getLogger("kvroute.reload")

ReloadResult = Literal["ok", "invalid", "unchanged"]
Listener = Callable[[Config, Config], None]

# Resources opened once at start: a changed value is accepted but takes effect on restart.
RESTART_ONLY = (
    "listen",
    "store",
    "upstream.max_connections",
    "upstream.client",
    "queue.max_size",
    "discovery",
    # Enforced by the HTTP server's protocol (proxy.api.server), set up once.
    "limits.max_header_bytes",
    "limits.header_timeout_s",
    "limits.max_buffered_body_bytes",
)


def config_hash(cfg: Config) -> str:
    """A short, stable hash of the effective config (after env overrides), for dashboards."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


def _pick(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def changed_sections(old: Config, new: Config) -> list[str]:
    """Top-level sections whose values differ (``backends``, ``routing``, ...)."""
    a, b = old.model_dump(), new.model_dump()
    return sorted(k for k in a if a[k] != b.get(k))


def restart_required(old: Config, new: Config) -> list[str]:
    a, b = old.model_dump(), new.model_dump()
    return [k for k in RESTART_ONLY if _pick(a, k) != _pick(b, k)]


class ConfigHolder:
    """The one place the running config lives. Readers take ``holder.current`` once per task;
    a reload replaces it whole and tells each listener (old, new) in registration order."""

    def __init__(self, cfg: Config, path: str | Path | None = None) -> None:
        self.current = cfg
        self.path = Path(path) if path is not None else None
        self.generation = 1
        self.hash = config_hash(cfg)
        self.loaded_at = time.time()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def swap(self, new: Config) -> None:
        """Synchronous: nothing else runs on the loop between the first and last listener."""
        old, self.current = self.current, new
        self.generation += 1
        self.hash = config_hash(new)
        self.loaded_at = time.time()
        for listener in self._listeners:
            listener(old, new)


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter(
            "kvroute_config_reload",
            "Config reloads by result: ok, unchanged, invalid (the running config was kept)",
            ["result"],
            registry=registry,
        )
        self.info = Info(
            "kvroute_config", "The loaded config: its hash and generation", registry=registry
        )
        self.last_ok = Gauge(
            "kvroute_config_last_reload_success_timestamp_seconds",
            "Unix time the running config was loaded",
            registry=registry,
        )
        for result in ("ok", "unchanged", "invalid"):
            self.total.labels(result)

    def loaded(self, holder: ConfigHolder) -> None:
        self.info.info({"hash": holder.hash, "generation": str(holder.generation)})
        self.last_ok.set(holder.loaded_at)


@dataclass
class ReloadOutcome:
    result: ReloadResult
    hash: str
    generation: int
    error: str | None = None
    changed: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)
    backends_added: list[str] = field(default_factory=list)
    backends_removed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class Reloader:
    """Serializes reloads (a SIGHUP during an admin reload waits its turn)."""

    def __init__(
        self,
        holder: ConfigHolder,
        metrics: ReloadMetrics,
        prepare: Sequence[Callable[[Config], Awaitable[object]]] = (),
        adjust: Callable[[Config], Config] | None = None,
    ) -> None:
        self.holder = holder
        self.metrics = metrics
        # Work a new config needs before it may serve (tokenizers): done before the swap, so
        # the first request after a reload does not pay for it, and a failure is "invalid".
        self.prepare = list(prepare)
        # Runs on the loop just before the swap (discovery adds the backends it found).
        self.adjust = adjust
        self._lock = asyncio.Lock()
        metrics.loaded(holder)

    def describe(self) -> dict[str, Any]:
        h = self.holder
        return {
            "hash": h.hash,
            "generation": h.generation,
            "loaded_at": h.loaded_at,
            # No file path: /fleet is open, and the path says nothing a client needs.
            "reloadable": h.path is not None,
        }

    async def reload(self, source: str) -> ReloadOutcome:
        async with self._lock:
            return await self._reload(source)

    async def _reload(self, source: str) -> ReloadOutcome:
        h = self.holder
        if h.path is None:
            return self._invalid("the gateway was started without a config file", source)
        try:
            # File I/O and validation off the loop; tokenizer-free, so this is quick.
            new = await asyncio.to_thread(load_config, h.path)
        except ConfigError as exc:
            return self._invalid(str(exc), source)
        for step in self.prepare:
            try:
                await step(new)
            except Exception as exc:  # whatever a step raises, the running config stays
                return self._invalid(f"{h.path}: {exc}", source)
        old = h.current
        if self.adjust is not None:
            new = self.adjust(new)
        changed = changed_sections(old, new)
        if not changed:
            self.metrics.total.labels("unchanged").inc()
            log.info("config reload (%s): %s unchanged (hash %s)", source, h.path, h.hash)
            return ReloadOutcome("unchanged", h.hash, h.generation)
        old_names = [b.name for b in old.backends]
        new_names = [b.name for b in new.backends]
        outcome = ReloadOutcome(
            "ok",
            "",
            0,
            changed=changed,
            restart_required=restart_required(old, new),
            backends_added=[n for n in new_names if n not in old_names],
            backends_removed=[n for n in old_names if n not in new_names],
        )
        h.swap(new)
        outcome.hash, outcome.generation = h.hash, h.generation
        self.metrics.total.labels("ok").inc()
        self.metrics.loaded(h)
        log.info(
            "config reloaded (%s): hash %s, changed %s; backends added %s, removed %s (drained: "
            "no new requests, in-flight ones finish)%s",
            source,
            h.hash,
            ", ".join(changed),
            outcome.backends_added or "none",
            outcome.backends_removed or "none",
            f"; needs a restart to apply: {', '.join(outcome.restart_required)}"
            if outcome.restart_required
            else "",
        )
        return outcome

    def _invalid(self, error: str, source: str) -> ReloadOutcome:
        self.metrics.total.labels("invalid").inc()
        log.error("config reload (%s) refused, the running config is kept:\n%s", source, error)
        return ReloadOutcome("invalid", self.holder.hash, self.holder.generation, error=error)

    @contextlib.contextmanager
    def on_sighup(self) -> Any:
        """SIGHUP reloads, while the context is open (main thread only; a no-op elsewhere)."""
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[ReloadOutcome]] = set()

        def fire() -> None:
            task = loop.create_task(self.reload("SIGHUP"))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        installed = False
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, fire)
            installed = True
        try:
            yield
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGHUP)
