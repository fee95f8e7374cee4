"""Fleet operations: restart hooks and the maintenance loop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.backends import KubernetesApiConfig
from proxy.config.base import _Strict

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError

HookType = Literal["http", "command", "kubernetes", "none"]


# The in-cluster defaults: every pod's service account is mounted here.
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
