"""Policies by the name ``routing.policy`` uses: one module each, registered here."""

from __future__ import annotations

from proxy.routing.kvroute import KvroutePolicy
from proxy.routing.least_loaded import LeastLoadedPolicy
from proxy.routing.most_free import MostFreePolicy
from proxy.routing.policy import Policy, PolicySettings
from proxy.routing.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {
    "kvroute": KvroutePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "most_free": MostFreePolicy,
}


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(settings=settings or PolicySettings())
