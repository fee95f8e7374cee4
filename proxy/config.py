"""The whole kvroute configuration as one typed model.

One explicit ``Config`` (as uvicorn has) built from a YAML file, then overridden by
``KVROUTE_*`` environment variables where that is natural for deployments (the Redis URL,
the admin key, the listen port). Validation errors name the offending key and value.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, model_validator

from proxy import config_errors
from proxy.config_errors import pydantic_problems

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError

BackendKind = Literal["vllm", "sglang", "tgi", "contiguous", "paged"]
PoolRole = Literal["general", "long"]
PolicyName = Literal["kvroute", "round_robin", "least_loaded", "most_free"]


class _Strict(BaseModel):
    """Base: unknown keys are errors, so a typo in a config file is never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendConfig(_Strict):
    """One inference server behind the gateway."""

    # No leading "-": a name is passed to restart hooks' argv, where it must not read as an option.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:][A-Za-z0-9_.:-]*$")
    url: HttpUrl
    pool: str = "general"
    kind: BackendKind = "vllm"
    capacity_tokens: int | None = Field(
        default=None, gt=0, description="override the reported KV capacity"
    )
    metrics_path: str = "/metrics"
    api_key: str | None = Field(
        default=None,
        min_length=1,
        description="sent upstream as 'Authorization: Bearer KEY' instead of the client's",
    )
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding api_key (read when the gateway starts)",
    )
    models: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        default=(),
        description="model ids served here; empty: discovered from the backend's /v1/models",
    )
    models_path: str = "/v1/models"
    prefill_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="queueing backends: prompt tokens prefilled per second (expected wait); "
        "none: 10000 per engine",
    )
    decode_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="queueing backends: output tokens per second per request; none: 30",
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> BackendConfig:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        return self

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def plain_url(self) -> str:
        """The URL without ``user:pass@``: the gateway sends those as a header (``credential``)."""
        parts = urlsplit(str(self.url))
        netloc = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")

    def credential(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The Authorization value sent upstream: api_key(_env) as Bearer, else the URL's user:pass."""
        key = self.api_key
        if key is None and self.api_key_env is not None:
            key = (os.environ if environ is None else environ).get(self.api_key_env) or None
        if key is not None:
            return f"Bearer {key}"
        if self.url.username is not None:
            user = unquote(self.url.username)
            password = unquote(self.url.password or "")
            return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return None


class PoolConfig(_Strict):
    """A named group of backends; ``role: long`` marks the dedicated long-request pool."""

    role: PoolRole = "general"


class PrefixConfig(_Strict):
    """Prefix-cache and session affinity (``proxy.routing.affinity``, ``proxy.core.prefix``)."""

    enabled: bool = Field(default=True, description="false: route by fit and length only")
    block_tokens: int = Field(
        default=16, gt=0, description="tokens per hashed block (vLLM's default block size)"
    )
    max_prompt_tokens: int = Field(
        default=131_072, ge=0, description="only this many leading prompt tokens are hashed"
    )
    ttl_s: float = Field(
        default=600.0, gt=0, description="a block not used for this long is forgotten"
    )
    pressure_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="the same on a node that is queueing, preempting or >95% full",
    )
    max_blocks_per_node: int = Field(
        default=200_000,
        gt=0,
        description="bound of the index per node (LRU; also <= its KV capacity)",
    )
    min_saving_tokens: int = Field(
        default=512, ge=0, description="a smaller expected saving leaves the fit order alone"
    )
    load_weight: float = Field(
        default=1.0, ge=0.0, le=1.0, description="score = saving x (1 - load_weight x utilisation)"
    )
    max_utilisation: float = Field(
        default=0.9, gt=0.0, le=1.0, description="a node fuller than this never wins by affinity"
    )
    discount_paged: bool = Field(
        default=True,
        description="paged, queueing servers: the cached prefix lowers the demand checked and reserved",
    )
    spread_new: bool = Field(
        default=True,
        description="paged fleets: a new long prefix goes where it displaces the least cached content",
    )
    session_header: str = Field(default="x-session-id", min_length=1)
    session_from_user: bool = Field(
        default=True, description="the OpenAI `user` field is a session key"
    )
    session_tokens: int = Field(
        default=1024, ge=0, description="the session's last node counts as this many cached tokens"
    )
    session_ttl_s: float = Field(default=1800.0, gt=0)
    max_sessions: int = Field(default=100_000, ge=0)


class RoutingConfig(_Strict):
    policy: PolicyName = "kvroute"
    long_threshold_tokens: int = Field(default=8_000, gt=0)
    default_max_tokens: int = Field(default=256, gt=0)
    max_tokens_limit: int = Field(
        default=1_000_000, gt=0, description="max_tokens above this is a 400"
    )
    safety_margin: float = Field(
        default=0.02, ge=0.0, lt=1.0, description="fraction of demand kept spare"
    )
    chat_tokens_per_message: int = Field(default=3, ge=0)
    chat_tokens_reply_priming: int = Field(default=3, ge=0)
    tokenize_in_thread_chars: int = Field(
        default=8_192, ge=0, description="prompts longer than this are tokenized off the event loop"
    )
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    unknown_model: Literal["reject", "pass_through"] = Field(
        default="reject",
        description="a model no backend lists: 404 model_not_found (as vLLM), or send it anyway",
    )
    spill_margin_s: float = Field(
        default=1.0,
        ge=0,
        description="a long request leaves the long pool when its expected wait exceeds a "
        "general node's by more than this (queueing backends)",
    )


class SizingConfig(_Strict):
    """How requests are sized for every model (``models.<name>`` overrides per model)."""

    tokenizer: str = Field(default="cl100k_base", description="tiktoken encoding name")
    tokenizer_file: Path | None = Field(
        default=None, description="a Hugging Face tokenizer.json (offline; wins over tokenizer)"
    )
    default_max_tokens: int | Literal["server"] | None = Field(
        default=None, description="output assumed without max_tokens; none: routing's"
    )
    tokens_per_name: int = Field(default=1, ge=0)
    tokens_per_tool: int = Field(default=3, ge=0)
    tokens_per_tool_call: int = Field(default=3, ge=0)
    image_part_tokens: int = Field(default=1024, ge=0)
    audio_part_tokens: int = Field(default=750, ge=0)
    video_part_tokens: int = Field(default=4096, ge=0)
    file_part_tokens: int = Field(default=1024, ge=0)
    prompt_embeds_bytes_per_token: int = Field(default=2048, gt=0)
    max_field_chars: int = Field(
        default=1_048_576, gt=0, description="a longer field counts its UTF-8 bytes, untokenized"
    )
    cache_entries: int = Field(default=16_384, ge=0)
    cache_min_chars: int = Field(default=256, ge=0)

    @model_validator(mode="after")
    def _file_exists(self) -> SizingConfig:
        _check_tokenizer_file(self.tokenizer_file)
        if isinstance(self.default_max_tokens, int) and self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be at least 1 (got {self.default_max_tokens})"
            )
        return self


class ModelConfig(_Strict):
    """One model's sizing: its tokenizer, chat-template overhead and default output."""

    tokenizer: str | None = None
    tokenizer_file: Path | None = None
    tokens_per_message: int | None = Field(default=None, ge=0)
    reply_priming: int | None = Field(default=None, ge=0)
    tokens_per_name: int | None = Field(default=None, ge=0)
    tokens_per_tool: int | None = Field(default=None, ge=0)
    image_part_tokens: int | None = Field(default=None, ge=0)
    audio_part_tokens: int | None = Field(default=None, ge=0)
    video_part_tokens: int | None = Field(default=None, ge=0)
    prompt_embeds_bytes_per_token: int | None = Field(default=None, gt=0)
    default_max_tokens: int | Literal["server"] | None = None
    max_model_len: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _file_exists(self) -> ModelConfig:
        _check_tokenizer_file(self.tokenizer_file)
        if isinstance(self.default_max_tokens, int) and self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be at least 1 (got {self.default_max_tokens})"
            )
        return self


def _check_tokenizer_file(path: Path | None) -> None:
    if path is not None and not path.is_file():
        raise ValueError(f"tokenizer_file: no such file (got {str(path)!r})")


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


class AuthConfig(_Strict):
    api_keys: list[str] = Field(
        default_factory=list,
        description="empty: /v1 needs no key; else a Bearer key from this list",
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


HookType = Literal["http", "command", "kubernetes", "none"]

# The in-cluster defaults: every pod's service account is mounted here.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubernetesApiConfig(_Strict):
    """How to reach the Kubernetes API: the in-cluster defaults, overridable (tests, kubectl proxy)."""

    api_url: str = "https://kubernetes.default.svc"
    token_path: str | None = f"{SERVICE_ACCOUNT_DIR}/token"
    ca_path: str | None = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
    namespace: str | None = Field(
        default=None, description="absent: the gateway pod's own namespace"
    )


class DiscoveryConfig(KubernetesApiConfig):
    """Where the backend list comes from: ``static`` (``backends``), ``kubernetes``, ``dns``."""

    type: Literal["static", "kubernetes", "dns"] = "static"
    label_selector: str = Field(
        default="", description="kubernetes: selects the inference Services' EndpointSlices"
    )
    port: int | str | None = Field(
        default=None, description="kubernetes: port number or name (absent: the slice's first port)"
    )
    pool_label: str = Field(
        default="kvroute.io/pool", description="kubernetes: the slice label naming the pool"
    )
    pool: str = Field(default="general", description="the pool when no pool label says otherwise")
    kind: BackendKind = "vllm"
    name: str | None = Field(default=None, description="dns: the name to resolve (A or SRV)")
    interval_s: float = Field(
        default=10.0, gt=0, description="dns: re-resolve period; kubernetes: watch timeout"
    )
    capacity_tokens: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _complete(self) -> DiscoveryConfig:
        if self.type == "dns" and not self.name:
            raise ValueError("discovery.name is required when discovery.type is 'dns'")
        if self.type == "dns" and self.port is not None and not isinstance(self.port, int):
            raise ValueError("discovery.port must be a number for dns (or absent with SRV)")
        return self


class RestartHookConfig(_Strict):
    """How to restart one backend's inference process. ``{name}`` and ``{url}`` are filled in."""

    type: HookType = "none"
    method: str = Field(default="POST", pattern=r"^[A-Za-z]+$")
    url: str | None = Field(default=None, description="http: e.g. '{url}/admin/restart'")
    headers: dict[str, str] = Field(default_factory=dict)
    argv: list[str] = Field(default_factory=list, description="command: run without a shell")
    timeout_s: float = Field(default=30.0, gt=0)
    pod_selector: str | None = Field(
        default=None, description="kubernetes: only pods matching this label selector are deleted"
    )
    kubernetes: KubernetesApiConfig = KubernetesApiConfig()

    @model_validator(mode="after")
    def _complete(self) -> RestartHookConfig:
        if self.type == "kubernetes" and not self.pod_selector:
            raise ValueError("hook.pod_selector is required when hook.type is 'kubernetes'")
        if self.pod_selector and ("(" in self.pod_selector or " in " in self.pod_selector):
            raise ValueError("hook.pod_selector: only equality selectors (a=b,c!=d) are supported")
        if self.type == "http" and not self.url:
            raise ValueError("hook.url is required when hook.type is 'http'")
        if self.type == "command" and not self.argv:
            raise ValueError("hook.argv is required when hook.type is 'command'")
        return self


class MaintenanceConfig(_Strict):
    """Diagnosis, scaling advice and the drain + rolling restart loop (see docs/operations.md)."""

    enabled: bool = Field(
        default=False,
        description="false: observe and advise only, never drain or restart by itself",
    )
    interval_s: float = Field(default=5.0, gt=0)
    restart_below_ratio: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="largest free block / total free below this is fragmented",
    )
    restart_after_s: float = Field(
        default=300.0, ge=0, description="... for at least this long before a restart"
    )
    min_free_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="nodes with less free memory are full, not fragmented"
    )
    restart_on_trend: bool = Field(
        default=False, description="also restart nodes whose fragmentation rises with uptime"
    )
    trend_window_s: float = Field(
        default=6 * 3600.0, gt=0, description="uptime window of the fragmentation trend"
    )
    trend_sample_interval_s: float = Field(default=60.0, ge=0)
    trend_min_samples: int = Field(default=10, ge=3)
    trend_slope_per_hour: float = Field(default=0.002, ge=0)
    trend_min_correlation: float = Field(default=0.7, ge=-1, le=1)
    trend_min_fragmentation: float = Field(default=0.3, ge=0, le=1)
    failure_window_s: float = Field(
        default=300.0, gt=0, description="allocation failures this recent shape the advice"
    )
    max_concurrent_restarts: int = Field(default=1, ge=1)
    min_healthy_capacity_fraction: float = Field(default=0.5, ge=0, le=1)
    min_interval_per_node_s: float = Field(default=3600.0, ge=0)
    drain_settle_s: float = Field(
        default=1.0, ge=0, description="after marking draining, before counting in-flight requests"
    )
    drain_timeout_s: float = Field(default=300.0, gt=0)
    healthy_timeout_s: float = Field(default=300.0, gt=0)
    fresh_ratio: float = Field(
        default=0.9, gt=0, le=1, description="a restarted node must report at least this ratio"
    )
    scheduled_restart_uptime_s: float | None = Field(
        default=None, gt=0, description="also restart any node up this long"
    )
    hook: RestartHookConfig = RestartHookConfig()


class Config(_Strict):
    listen: ListenConfig = ListenConfig()
    backends: list[BackendConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = DiscoveryConfig()
    pools: dict[str, PoolConfig] = Field(default_factory=lambda: {"general": PoolConfig()})
    routing: RoutingConfig = RoutingConfig()
    store: StoreConfig = StoreConfig()
    collector: CollectorConfig = CollectorConfig()
    retry: RetryConfig = RetryConfig()
    queue: QueueConfig = QueueConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    admin: AdminConfig = AdminConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    sizing: SizingConfig = SizingConfig()
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    log: LogConfig = LogConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if not self.backends and self.discovery.type == "static":
            raise ValueError("backends: at least one backend is required (or a discovery section)")
        if self.discovery.type != "static" and self.discovery.pool not in self.pools:
            raise ValueError(f"discovery.pool: {self.discovery.pool!r} is not a defined pool")
        seen: set[str] = set()
        for i, b in enumerate(self.backends):
            if b.name in seen:
                raise ValueError(f"backends.{i}.name: duplicate backend name {b.name!r}")
            seen.add(b.name)
            if b.pool not in self.pools:
                raise ValueError(
                    f"backends.{i}.pool: {b.pool!r} is not a defined pool (defined: {sorted(self.pools)})"
                )
        return self

    def pool_role(self, pool: str) -> PoolRole:
        return self.pools[pool].role

    def backend(self, name: str) -> BackendConfig:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)


# Environment variable -> dotted config key. Only what deployments typically inject.
ENV_OVERRIDES: dict[str, str] = {
    "KVROUTE_REDIS_URL": "store.redis_url",
    "KVROUTE_ADMIN_KEY": "admin.api_key",
    "KVROUTE_POLICY": "routing.policy",
    "KVROUTE_HOST": "listen.host",
    "KVROUTE_PORT": "listen.port",
    "KVROUTE_LONG_THRESHOLD_TOKENS": "routing.long_threshold_tokens",
}


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[leaf] = value


def apply_env(
    data: dict[str, Any], environ: dict[str, str] | os._Environ[str] | None = None
) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    for var, key in ENV_OVERRIDES.items():
        if var in env:
            _set_dotted(data, key, env[var] if env[var] != "" else None)
    return data


def _format_errors(err: ValidationError, data: dict[str, Any], source: str) -> str:
    # Config-level (loc ()) errors are the cross checks, which cross_problems reports itself.
    lines = pydantic_problems((e for e in err.errors() if e["loc"]), data, Config)
    return config_errors.report(source, lines + config_errors.cross_problems(data))


def parse_config(
    data: Any, source: str = "<config>", environ: dict[str, str] | None = None
) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data = apply_env(dict(data), environ)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, data, source)) from None


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data, str(p), environ)
