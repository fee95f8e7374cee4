"""Shared state and what feeds it: the store (Redis, Sentinel, Cluster) and the collector."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.base import _Strict

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError


class SentinelConfig(_Strict):
    """Redis Sentinel: the gateway asks the sentinels for the current master of ``master``."""

    master: str = Field(min_length=1, description="the master's name in the sentinels' config")
    nodes: list[str] = Field(min_length=1, description="sentinels as host:port")
    db: int = Field(default=0, ge=0)
    password: str | None = Field(default=None, description="the Redis servers' password")
    sentinel_password: str | None = None

    @model_validator(mode="after")
    def _host_ports(self) -> SentinelConfig:
        for i, node in enumerate(self.nodes):
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"nodes.{i}: {node!r} is not host:port")
        return self

    def addresses(self) -> list[tuple[str, int]]:
        return [(n.rpartition(":")[0].strip("[]"), int(n.rpartition(":")[2])) for n in self.nodes]


class StoreConfig(_Strict):
    redis_url: str | None = Field(default=None, description="absent: the embedded in-process store")
    sentinel: SentinelConfig | None = Field(
        default=None, description="Redis through Sentinel (instead of redis_url)"
    )
    cluster: bool = Field(
        default=False, description="redis_url names a seed node of a Redis Cluster"
    )
    key_prefix: str = "kvroute"
    op_timeout_s: float = Field(default=0.1, gt=0)
    reservation_ttl_s: float = Field(default=900.0, gt=0)
    leases: bool = Field(
        default=True,
        description="each replica holds a lease in Redis; its reservations stop counting "
        "lease_ttl_s after it stops renewing (killed, frozen, cut off). false: a dead "
        "replica's reservations count until reservation_ttl_s (docs/reliability.md)",
    )
    lease_ttl_s: float = Field(
        default=5.0,
        ge=0.3,
        le=60.0,
        description="a replica's lease, renewed every third of it: how long a dead replica's "
        "reservations still count",
    )
    report_grace_s: float = Field(
        default=0.25,
        ge=0,
        description="reservations this close before a report still count as not yet visible in it",
    )
    max_snapshot_age_s: float = Field(
        default=30.0,
        gt=0,
        description="with the store down, routing uses the last snapshot up to this age",
    )
    breaker_failures: int = Field(
        default=3,
        ge=1,
        description="consecutive store failures on the request path that open the circuit",
    )
    breaker_open_s: float = Field(
        default=1.0,
        gt=0,
        description="an open circuit fails store calls at once for this long, then lets one probe through",
    )
    degraded_mode: Literal["local", "snapshot"] = Field(
        default="local",
        description="with Redis unreachable: local (scrape and reserve in this replica) or "
        "snapshot (the last shared snapshot, then length only)",
    )

    @model_validator(mode="after")
    def _one_redis(self) -> StoreConfig:
        if self.sentinel is not None and self.redis_url:
            raise ValueError("store: set redis_url or sentinel, not both")
        if self.cluster and not self.redis_url:
            raise ValueError("store.cluster needs store.redis_url (any node of the cluster)")
        return self

    @property
    def uses_redis(self) -> bool:
        return bool(self.redis_url) or self.sentinel is not None


class CollectorConfig(_Strict):
    scrape_interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    report_ttl_s: float = Field(default=60.0, gt=0)
    models_refresh_s: float = Field(
        default=30.0, gt=0, description="how often each backend's /v1/models is read again"
    )
    pressure_hold_s: float = Field(
        default=5.0,
        ge=0,
        description="a node that showed queueing, preemption or full slots stays full this long",
    )
    fall: int = Field(
        default=2, ge=1, description="failed scrapes in a row before a backend is marked down"
    )
    rise: int = Field(
        default=1, ge=1, description="good scrapes in a row before a down backend is marked up"
    )

    @model_validator(mode="after")
    def _stale_after_interval(self) -> CollectorConfig:
        if self.stale_after_s < self.scrape_interval_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must be >= scrape_interval_s ({self.scrape_interval_s})"
            )
        return self
