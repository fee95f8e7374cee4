"""The state store: per-backend reports, the gateway's overlay, retry memory, locks, events.

``open_store(cfg)`` picks the implementation: Redis when ``store.redis_url`` or
``store.sentinel`` is set (shared by every gateway replica; single server, Sentinel or Cluster), else the embedded in-process store (one gateway).
"""

from __future__ import annotations

from proxy.config import StoreConfig
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
from proxy.state.memory import InProcessStore
from proxy.state.redis_store import RedisStore

__all__ = [
    "BackendState",
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
]


def open_store(cfg: StoreConfig) -> StateStore:
    """The configured store. Does no I/O: Redis connects on first use (call ``ping`` to check)."""
    if cfg.uses_redis:
        return RedisStore(cfg)
    return InProcessStore()
