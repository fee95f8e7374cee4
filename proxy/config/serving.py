"""The request path's limits: retries, admission queue, upstream timeouts, limits, health, auth."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.base import _Strict

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError


class RetryConfig(_Strict):
    max_attempts: int = Field(default=3, ge=1, le=16)
    retry_key_ttl_s: float = Field(default=300.0, gt=0)
    ceiling_ttl_s: float = Field(
        default=30.0, gt=0, description="how long a node stays 'cannot fit N' after failing N"
    )
    hash_body: bool = Field(
        default=False, description="treat identical bodies as the same client retry"
    )
    budget_percent: float = Field(
        default=20.0,
        ge=0,
        le=100,
        description="retries of failed attempts in flight, as a share of active requests",
    )
    budget_min_concurrency: int = Field(
        default=3, ge=0, description="retries always allowed in flight, whatever the share"
    )
    max_retry_after_s: float = Field(
        default=30.0,
        ge=0,
        description="a backend's Retry-After cools it down for at most this long",
    )


class QueueConfig(_Strict):
    max_size: int = Field(default=256, ge=0)
    max_wait_s: float = Field(default=5.0, ge=0)
    retry_after_s: int = Field(default=2, ge=1)


class UpstreamConfig(_Strict):
    connect_timeout_s: float = Field(default=2.0, gt=0)
    ttfb_timeout_s: float = Field(
        default=120.0, gt=0, description="until response headers (a stream: its first event)"
    )
    non_stream_s_per_token: float = Field(
        default=0.2,
        ge=0,
        description="a non-streamed answer's headers may also take this per requested output token",
    )
    idle_timeout_s: float = Field(default=60.0, gt=0)
    total_timeout_s: float = Field(default=600.0, gt=0)
    max_connections: int = Field(default=1024, gt=0)
    client: Literal["lean", "aiohttp"] = Field(
        default="lean",
        description="HTTP client for the POSTs to backends: lean (asyncio + httptools) or aiohttp",
    )
    max_answer_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="a non-streamed answer above this is refused as a bad response (502)",
    )


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_concurrent_requests: int = Field(default=4096, gt=0)
    max_header_bytes: int = Field(
        default=32 * 1024,
        gt=0,
        description="all request header names and values together (431 above)",
    )
    retry_after_s: int = Field(
        default=1,
        ge=1,
        description="Retry-After sent with 429 when max_concurrent_requests is reached",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a connection must deliver a request's whole header block within this",
    )
    body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="grace for a request body; after it the body must keep body_min_rate_bytes_s",
    )
    body_min_rate_bytes_s: int = Field(
        default=4096, gt=0, description="average rate a body must keep once body_timeout_s passed"
    )
    max_buffered_body_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="request bodies held across all requests at once (429 above)",
    )


class ActiveHealthConfig(_Strict):
    """Probe each backend's health path; ``fall`` failures in a row mark it unhealthy, ``rise`` successes healthy again."""

    enabled: bool = True
    path: str = "/health"
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    rise: int = Field(default=2, ge=1)
    fall: int = Field(default=3, ge=1)


class OutlierConfig(_Strict):
    """Passive ejection from real traffic, as Envoy's outlier detection does."""

    consecutive_failures: int = Field(
        default=5, ge=1, description="connect failures, timeouts or non-allocation 5xx in a row"
    )
    base_ejection_s: float = Field(
        default=30.0, gt=0, description="ejected for this x the number of its ejections"
    )
    max_ejection_s: float = Field(default=300.0, gt=0)
    max_ejection_percent: float = Field(
        default=50.0, ge=0, le=100, description="never eject more of the fleet than this"
    )
    panic_threshold_percent: float = Field(
        default=50.0, ge=0, le=100, description="below this share of healthy backends, route to all"
    )


class HealthConfig(_Strict):
    active: ActiveHealthConfig = ActiveHealthConfig()
    outlier: OutlierConfig = OutlierConfig()


#: What a client's ``Authorization`` header becomes upstream (docs/operations.md, "Authorization").
ClientAuthorization = Literal["never", "when_no_backend_key", "always"]


class AuthConfig(_Strict):
    api_keys: list[str] = Field(
        default_factory=list,
        description="empty: /v1 needs no key; else a Bearer key from this list",
    )
    forward_client_authorization: ClientAuthorization = Field(
        default="never",
        description=(
            "never: a backend sees only its own backends[].api_key; when_no_backend_key: the "
            "client's header reaches backends without one; always: the client's header wins"
        ),
    )

    @model_validator(mode="after")
    def _no_gateway_key_upstream(self) -> AuthConfig:
        # With api_keys the header holds a gateway key: passing it on hands it to every backend.
        if self.api_keys and self.forward_client_authorization != "never":
            raise ValueError(
                "auth.forward_client_authorization: "
                f"{self.forward_client_authorization!r} would send the gateway's own keys "
                "(auth.api_keys) to backends; use 'never' while auth.api_keys is set"
            )
        return self


class ShutdownConfig(_Strict):
    """How a stopping gateway treats what is in flight (docs/operations.md, "Shutdown")."""

    drain_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description=(
            "after SIGTERM, in-flight requests may finish for this long; streams still "
            "running then end with a final SSE error event (match upstream.total_timeout_s)"
        ),
    )


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)


class LogConfig(_Strict):
    access_log: bool = Field(
        default=False,
        description="one line per /v1 request: id, model, class, demand, backend, attempts, status, duration",
    )


class AdminConfig(_Strict):
    api_key: str | None = Field(default=None, description="absent: admin endpoints are disabled")
