"""Routing: classify a request and rank backends for it; pure, shared with the simulator.

``policy`` holds the contract (``Policy``, ``RouteRequest``, ``PolicySettings``); each policy
has its own module (``kvroute``, ``round_robin``, ``least_loaded``, ``most_free``) and
``registry`` finds them by name.
"""

from proxy.routing.kvroute import KvroutePolicy, KvrouteWeights
from proxy.routing.least_loaded import LeastLoadedPolicy
from proxy.routing.most_free import MostFreePolicy
from proxy.routing.policy import (
    Policy,
    PolicySettings,
    RequestClass,
    RouteRequest,
    classify,
    eligible,
    nothing_fits_reason,
)
from proxy.routing.registry import POLICIES, make_policy
from proxy.routing.round_robin import RoundRobinPolicy

__all__ = [
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
]
