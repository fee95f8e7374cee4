"""InferencePool discovery: the pods an ``InferencePool`` selects are the backends.

The Gateway API Inference Extension's ``InferencePool`` (``inference.networking.k8s.io/v1``)
names its model servers by ``spec.selector.matchLabels`` in its own namespace, and their
port(s) by ``spec.targetPorts``; each ready pod's IP and each target port is one endpoint
(a pod with two target ports is two). Reading the pool itself keeps the endpoint picker and
the gateway on one definition of the fleet, without a Service labelled for kvroute.

Polled every ``discovery.interval_s``: the pool (its selector may change), then its pods. A
pod is a backend while it is Running, Ready, not terminating and has an IP. Its pool and
serving role come from the pod's own ``pool_label`` and ``role_label``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proxy.backends.discovery import backend
from proxy.backends.discovery_kubernetes import KubernetesApiDiscovery, serving_role
from proxy.config import BackendConfig, DiscoveryConfig

log = logging.getLogger("kvroute.discovery")


def pool_selector(pool: dict[str, Any]) -> tuple[str, list[int]]:
    """The pool's label selector (``k=v,...``) and target ports; ValueError if it has none."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p["number"] for p in spec.get("targetPorts") or [] if isinstance(p.get("number"), int)]
    if not labels or not ports:
        name = (pool.get("metadata") or {}).get("name")
        raise ValueError(f"InferencePool {name}: no selector.matchLabels or targetPorts")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports


def pod_ready(pod: dict[str, Any]) -> str | None:
    """The pod's IP when it may take requests (Running, Ready, not terminating), else None."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    return str(ip) if ready and ip else None


def pool_backends(
    cfg: DiscoveryConfig, ports: list[int], pods: list[dict[str, Any]], pools: set[str]
) -> list[BackendConfig]:
    """The backends of the pool's ready pods (pure: the shapes of core/v1 Pods)."""
    out: list[BackendConfig] = []
    for pod in pods:
        ip = pod_ready(pod)
        if ip is None:
            continue
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        name = str(meta.get("name") or ip)
        pool = labels.get(cfg.pool_label, cfg.pool)
        pool = pool if pool in pools else cfg.pool
        role = serving_role(labels.get(cfg.role_label), name)
        for port in ports:
            shown = name if len(ports) == 1 else f"{name}:{port}"
            out.append(backend(cfg, shown, ip, port, pool, role))
    return out


class InferencePoolDiscovery(KubernetesApiDiscovery):
    async def resolve(self) -> list[BackendConfig]:
        name = self.cfg.inference_pool
        assert name is not None  # the config model requires it for inferencepool
        selector, ports = pool_selector(await self.api.get_inference_pool(name))
        pods = await self.api.list_pods(selector)
        return pool_backends(self.cfg, ports, pods, self.pools)

    async def first_list(self) -> None:
        self.publish(await self.resolve())

    async def _run(self) -> None:
        await asyncio.sleep(self.cfg.interval_s)
        self.publish(await self.resolve())

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
