"""What each running part does with a reloaded config (see proxy.api.reload).

Every function here is a ``ConfigHolder`` listener: synchronous, no I/O, so the whole swap
happens between two awaits and no request sees a half-applied reload. Parts keep the state
they learned (health, ejections, reservations, trend samples); only what the config decides
changes. A backend that left the config disappears from the fleet snapshot (no new requests)
but keeps its URL in the gateway's table, so requests already on it finish normally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.api.reload import ConfigHolder
from proxy.backends.collector import Collector
from proxy.config import Config
from proxy.gateway.affinity import Affinity, affinity_settings
from proxy.gateway.walk import Gateway
from proxy.ops.maintenance import Maintenance
from proxy.ops.restart_hooks import make_hook
from proxy.routing import Policy, PolicySettings, make_policy
from proxy.state.fleet_cache import FleetCache

SetCfg = Callable[[Config], None]
# Tasks closing replaced hooks: referenced until done, so none is garbage-collected mid-way.
_closing: set[asyncio.Task[None]] = set()


def policy_for(cfg: Config) -> Policy:
    settings = PolicySettings(
        safety_margin=cfg.routing.safety_margin,
        stale_after_s=cfg.collector.stale_after_s,
        long_threshold_tokens=cfg.routing.long_threshold_tokens,
        affinity=affinity_settings(cfg.routing.prefix),
    )
    return make_policy(cfg.routing.policy, settings)


def reconfigure_gateway(gateway: Gateway, old: Config, new: Config) -> None:
    # The backend list (URLs of backends that left are kept for requests still on them).
    gateway.reconfigure(new)
    # What a discovered backend list never changes, a reloaded file can.
    if old.routing != new.routing or old.collector.stale_after_s != new.collector.stale_after_s:
        gateway.policy = policy_for(new)
    if old.routing.prefix != new.routing.prefix:
        # New index settings: start a fresh index (it is a hint; a miss costs one prefill).
        fresh = Affinity(new)
        # The shared stream (routing.prefix.share) is the app's: it stays, feeding the new index.
        fresh.share = gateway.affinity.share
        fresh.rates = gateway.affinity.rates
        # The KV-event feeds are the app's too (started once): the new index keeps them.
        fresh.exact = gateway.affinity.exact
        gateway.affinity = fresh
    gateway.health.cfg = new.health
    if gateway.checker is not None:
        gateway.checker.interval_s = new.health.active.interval_s


def reconfigure_maintenance(ops: Maintenance, old: Config, new: Config) -> None:
    ops.reconfigure(new)
    ops.settings = new.maintenance
    if old.maintenance.hook != new.maintenance.hook:
        replaced, ops.hook = ops.hook, make_hook(new.maintenance.hook)
        # Close the old hook's resources (an HTTP session) once the loop gets to it.
        task = asyncio.get_running_loop().create_task(replaced.close())
        _closing.add(task)
        task.add_done_callback(_closing.discard)


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
    # Removed backends leave the snapshot: the policy no longer offers them (drained).
    holder.subscribe(lambda old, new: fleet.reconfigure(new))
    holder.subscribe(lambda old, new: reconfigure_gateway(gateway, old, new))
    if collector is not None:
        holder.subscribe(lambda old, new: collector.reconfigure(new))
    holder.subscribe(lambda old, new: reconfigure_maintenance(ops, old, new))
