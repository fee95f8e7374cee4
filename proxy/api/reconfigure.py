"""What each running part does with a reloaded config (see proxy.api.reload).

Every function here is a ``ConfigHolder`` listener: synchronous, no I/O, so the whole swap
happens between two awaits and no request sees a half-applied reload. Parts keep the state
they learned (health, ejections, reservations, trend samples); only what the config decides
changes. A backend that left the config disappears from the fleet snapshot (no new requests)
but keeps its URL in the gateway's table, so requests already on it finish normally.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.api.reload import ConfigHolder
from proxy.backends.collector import Collector
from proxy.config import Config
from proxy.gateway.walk import Gateway
from proxy.ops.maintenance import Maintenance
from proxy.ops.restart_hooks import make_hook
from proxy.routing.policy import Policy, PolicySettings, make_policy
from proxy.state.fleet_cache import FleetCache

SetCfg = Callable[[Config], None]


def policy_for(cfg: Config) -> Policy:
    settings = PolicySettings(
        safety_margin=cfg.routing.safety_margin,
        stale_after_s=cfg.collector.stale_after_s,
        long_threshold_tokens=cfg.routing.long_threshold_tokens,
    )
    return make_policy(cfg.routing.policy, settings)


def reconfigure_fleet(fleet: FleetCache, new: Config) -> None:
    fleet.cfg = new
    # Removed backends leave the snapshot: the policy no longer offers them (drained).
    fleet.names = [b.name for b in new.backends]


def reconfigure_gateway(gateway: Gateway, old: Config, new: Config) -> None:
    gateway.cfg = new
    gateway.policy = policy_for(new)
    # Keep the URLs of backends that left: requests already on them still need them.
    gateway.urls = {**gateway.urls, **{b.name: b.base_url for b in new.backends}}
    gateway.health.cfg = new.health
    gateway.health.retain({b.name for b in new.backends})
    checker = gateway.checker
    if checker is not None:
        path = new.health.active.path
        path = path if path.startswith("/") else "/" + path
        checker.urls = {b.name: b.base_url + path for b in new.backends}
        checker.interval_s = new.health.active.interval_s


def reconfigure_maintenance(ops: Maintenance, old: Config, new: Config) -> None:
    ops.cfg = new
    ops.m = new.maintenance
    ops.urls = {b.name: b.base_url for b in new.backends}
    if old.maintenance.hook != new.maintenance.hook:
        ops.hook = make_hook(new.maintenance.hook)


def follow(
    holder: ConfigHolder,
    gateway: Gateway,
    fleet: FleetCache,
    collector: Collector | None,
    ops: Maintenance,
    set_runtime_cfg: SetCfg,
) -> None:
    """Subscribe every part, in the order a request meets them: snapshot first, then routing."""
    holder.subscribe(lambda old, new: set_runtime_cfg(new))
    holder.subscribe(lambda old, new: reconfigure_fleet(fleet, new))
    holder.subscribe(lambda old, new: reconfigure_gateway(gateway, old, new))
    if collector is not None:
        holder.subscribe(lambda old, new: collector.reconfigure(new))
    holder.subscribe(lambda old, new: reconfigure_maintenance(ops, old, new))
