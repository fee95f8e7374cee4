"""kvroute: a fragmentation-aware gateway for LLM inference fleets.

The public API, importable from ``proxy`` itself: the config model, the error tree, the
fleet model the policies rank, the policies and their registry, the state stores and the
background-loop helper. The app itself is built by ``kvroute serve`` (``proxy.cli``).

Names are loaded on first use (PEP 562), so ``import proxy.core.fleet`` from the simulator
does not pull in the gateway's I/O stack through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.config import Config, load_config, parse_config
    from proxy.core.fleet import (
        AllocatorKind,
        FailureCause,
        FleetSnapshot,
        MemoryReport,
        NodeView,
        Overlay,
        classify_failure,
    )
    from proxy.errors import (
        AnswerTooLarge,
        ApiError,
        BadAnswer,
        BodyTimeout,
        ConfigError,
        ConnectionLost,
        KubernetesApiError,
        KvrouteError,
        RestartFailed,
        RestartRefused,
        ScrapeError,
        StoreUnavailable,
        UpstreamBroken,
        UpstreamConnectError,
        UpstreamError,
        UpstreamTimeout,
        WatchExpired,
        WireError,
    )
    from proxy.routing import (
        POLICIES,
        KvroutePolicy,
        KvrouteWeights,
        LeastLoadedPolicy,
        MostFreePolicy,
        Policy,
        PolicySettings,
        RequestClass,
        RoundRobinPolicy,
        RouteRequest,
        classify,
        eligible,
        make_policy,
        nothing_fits_reason,
    )
    from proxy.state import BackendState, InProcessStore, RedisStore, StateStore, open_store
    from proxy.tasks import PeriodicTask

# The module that defines each public name.
_HOMES: dict[str, tuple[str, ...]] = {
    "proxy.config": (
        "Config",
        "load_config",
        "parse_config",
    ),
    "proxy.core.fleet": (
        "AllocatorKind",
        "FailureCause",
        "FleetSnapshot",
        "MemoryReport",
        "NodeView",
        "Overlay",
        "classify_failure",
    ),
    "proxy.errors": (
        "AnswerTooLarge",
        "ApiError",
        "BadAnswer",
        "BodyTimeout",
        "ConfigError",
        "ConnectionLost",
        "KubernetesApiError",
        "KvrouteError",
        "RestartFailed",
        "RestartRefused",
        "ScrapeError",
        "StoreUnavailable",
        "UpstreamBroken",
        "UpstreamConnectError",
        "UpstreamError",
        "UpstreamTimeout",
        "WatchExpired",
        "WireError",
    ),
    "proxy.routing": (
        "POLICIES",
        "KvroutePolicy",
        "KvrouteWeights",
        "LeastLoadedPolicy",
        "MostFreePolicy",
        "Policy",
        "PolicySettings",
        "RequestClass",
        "RoundRobinPolicy",
        "RouteRequest",
        "classify",
        "eligible",
        "make_policy",
        "nothing_fits_reason",
    ),
    "proxy.state": (
        "BackendState",
        "InProcessStore",
        "RedisStore",
        "StateStore",
        "open_store",
    ),
    "proxy.tasks": ("PeriodicTask",),
}
_HOME: dict[str, str] = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "POLICIES",
    "AllocatorKind",
    "AnswerTooLarge",
    "ApiError",
    "BackendState",
    "BadAnswer",
    "BodyTimeout",
    "Config",
    "ConfigError",
    "ConnectionLost",
    "FailureCause",
    "FleetSnapshot",
    "InProcessStore",
    "KubernetesApiError",
    "KvrouteError",
    "KvroutePolicy",
    "KvrouteWeights",
    "LeastLoadedPolicy",
    "MemoryReport",
    "MostFreePolicy",
    "NodeView",
    "Overlay",
    "PeriodicTask",
    "Policy",
    "PolicySettings",
    "RedisStore",
    "RequestClass",
    "RestartFailed",
    "RestartRefused",
    "RoundRobinPolicy",
    "RouteRequest",
    "ScrapeError",
    "StateStore",
    "StoreUnavailable",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "WatchExpired",
    "WireError",
    "classify",
    "classify_failure",
    "eligible",
    "load_config",
    "make_policy",
    "nothing_fits_reason",
    "open_store",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'proxy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
