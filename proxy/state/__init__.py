"""The state store: per-backend reports, the gateway's overlay, retry memory, locks, events.

``open_store(cfg)`` picks the implementation: Redis when ``store.redis_url`` or
``store.sentinel`` is set (shared by every gateway replica; single server, Sentinel or Cluster), else the embedded in-process store (one gateway).
"""

from __future__ import annotations

from proxy.config import Config, StoreConfig
from proxy.state.base import (
    BackendState,
    Flags,
    Reservation,
    StateStore,
    Status,
    StoreUnavailable,
    build_overlay,
    ceiling_in_force,
    live_reservations,
    merge_ceiling,
    pending_tokens,
    reservation_fits,
)
from proxy.state.breaker import CircuitBreaker
from proxy.state.degraded import DegradedStore
from proxy.state.memory import InProcessStore
from proxy.state.redis_store import RedisStore

__all__ = [
    "BackendState",
    "DegradedStore",
    "Flags",
    "InProcessStore",
    "RedisStore",
    "Reservation",
    "StateStore",
    "Status",
    "StoreUnavailable",
    "build_overlay",
    "ceiling_in_force",
    "live_reservations",
    "merge_ceiling",
    "open_store",
    "pending_tokens",
    "reservation_fits",
    "with_local_fallback",
]


def open_store(cfg: StoreConfig) -> StateStore:
    """The configured store. Does no I/O: Redis connects on first use (call ``ping`` to check)."""
    if cfg.uses_redis:
        return RedisStore(cfg)
    return InProcessStore()


def with_local_fallback(store: StateStore, cfg: Config) -> StateStore:
    """The store the gateway runs on: a shared store gets degraded mode (store.degraded_mode)."""
    if isinstance(store, InProcessStore | DegradedStore) or cfg.store.degraded_mode != "local":
        return store
    breaker = CircuitBreaker(cfg.store.breaker_failures, cfg.store.breaker_open_s)
    return DegradedStore(
        store,
        breaker,
        reservation_ttl_s=cfg.store.reservation_ttl_s,
        report_ttl_s=cfg.collector.report_ttl_s,
    )
