"""The whole kvroute configuration as one typed model.

One explicit ``Config`` (as uvicorn has) built from a YAML file, then overridden by
``KVROUTE_*`` environment variables where that is natural for deployments (the Redis URL,
the admin key, the listen port). Validation errors name the offending key and value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from proxy import config_errors
from proxy.config.backends import SERVICE_ACCOUNT_DIR as SERVICE_ACCOUNT_DIR
from proxy.config.backends import BackendConfig as BackendConfig
from proxy.config.backends import DiscoveryConfig as DiscoveryConfig
from proxy.config.backends import KubernetesApiConfig as KubernetesApiConfig
from proxy.config.backends import PoolConfig as PoolConfig
from proxy.config.base import BackendKind as BackendKind
from proxy.config.base import PolicyName as PolicyName
from proxy.config.base import PoolRole as PoolRole
from proxy.config.base import ServingRole as ServingRole
from proxy.config.base import _Strict as _Strict
from proxy.config.continuation import ContinuationConfig as ContinuationConfig
from proxy.config.disaggregation import DisaggregationConfig as DisaggregationConfig
from proxy.config.disaggregation import check_sglang_fleet
from proxy.config.kv_events import KvEventsEndpoint as KvEventsEndpoint
from proxy.config.kv_events import KvEventsSettings as KvEventsSettings
from proxy.config.memory_pressure import MemoryPressureConfig as MemoryPressureConfig
from proxy.config.ops import HookType as HookType
from proxy.config.ops import MaintenanceConfig as MaintenanceConfig
from proxy.config.ops import RestartHookConfig as RestartHookConfig
from proxy.config.routing import ModelConfig as ModelConfig
from proxy.config.routing import PrefixConfig as PrefixConfig
from proxy.config.routing import RoutingConfig as RoutingConfig
from proxy.config.routing import SizingConfig as SizingConfig
from proxy.config.serving import ActiveHealthConfig as ActiveHealthConfig
from proxy.config.serving import AdminConfig as AdminConfig
from proxy.config.serving import AuthConfig as AuthConfig
from proxy.config.serving import HealthConfig as HealthConfig
from proxy.config.serving import LimitsConfig as LimitsConfig
from proxy.config.serving import ListenConfig as ListenConfig
from proxy.config.serving import LogConfig as LogConfig
from proxy.config.serving import OutlierConfig as OutlierConfig
from proxy.config.serving import QueueConfig as QueueConfig
from proxy.config.serving import RetryConfig as RetryConfig
from proxy.config.serving import ShutdownConfig as ShutdownConfig
from proxy.config.serving import UpstreamConfig as UpstreamConfig
from proxy.config.store import CollectorConfig as CollectorConfig
from proxy.config.store import SentinelConfig as SentinelConfig
from proxy.config.store import StoreConfig as StoreConfig
from proxy.config_errors import pydantic_problems

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError


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
    memory_pressure: MemoryPressureConfig = MemoryPressureConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    continuation: ContinuationConfig = ContinuationConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    admin: AdminConfig = AdminConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    sizing: SizingConfig = SizingConfig()
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    log: LogConfig = LogConfig()
    shutdown: ShutdownConfig = ShutdownConfig()

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
        if self.disaggregation.protocol == "sglang":
            check_sglang_fleet(self.backends)
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
    # The drain on SIGTERM: keep it under the orchestrator's grace period (docs/operations.md).
    "KVROUTE_DRAIN_S": "shutdown.drain_s",
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
    return config_errors.problems_message(source, lines + config_errors.cross_problems(data))


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
