"""Kubernetes discovery: every ready endpoint of the selected EndpointSlices is a backend.

The documented list + watch protocol: list the slices (``labelSelector``), remember the
list's ``resourceVersion``, watch from it (ADDED / MODIFIED / DELETED / BOOKMARK events,
each carrying the object's new ``resourceVersion``), and list again when the watch says
``410 Gone`` (the version was compacted away) or ends. Endpoint conditions: ``ready`` false
(starting, failing readiness, terminating) is left out; absent counts as ready, as the API
documents. A backend is named after its pod (``targetRef.name``), which is what the
``kubernetes`` restart hook deletes; its pool is the slice's ``pool_label`` (the Service's
label, which the EndpointSlice controller copies), else ``discovery.pool``.
"""

from __future__ import annotations

import logging
from typing import Any

from proxy.backends.discovery import Discovery, backend
from proxy.config import BackendConfig, DiscoveryConfig
from proxy.config.base import ServingRole
from proxy.errors import KubernetesApiError, WatchExpired
from proxy.upstream.kubernetes_api import KubernetesApi

log = logging.getLogger("kvroute.discovery")


def _port(cfg: DiscoveryConfig, ports: list[dict[str, Any]]) -> int | None:
    if isinstance(cfg.port, int):
        return cfg.port
    for p in ports:
        if cfg.port is None or p.get("name") == cfg.port:
            number = p.get("port")
            return number if isinstance(number, int) else None
    return None


def slice_backends(
    cfg: DiscoveryConfig, obj: dict[str, Any], pools: set[str]
) -> list[BackendConfig]:
    """The backends one EndpointSlice contributes (pure: the shapes of discovery.k8s.io/v1)."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    pool = labels.get(cfg.pool_label, cfg.pool)
    if pool not in pools:
        log.warning(
            "EndpointSlice %s: pool %r is not configured; using %r",
            meta.get("name"),
            pool,
            cfg.pool,
        )
        pool = cfg.pool
    role = serving_role(labels.get(cfg.role_label), meta.get("name"))
    port = _port(cfg, obj.get("ports") or [])
    if port is None:
        return []
    out: list[BackendConfig] = []
    for ep in obj.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        ref = ep.get("targetRef") or {}
        name = ref.get("name") if ref.get("kind") == "Pod" else None
        name = name or ep.get("hostname") or str(addresses[0]).replace(":", "-")
        out.append(backend(cfg, str(name), str(addresses[0]), port, pool, role))
    return out


def serving_role(label: object, slice_name: object) -> ServingRole:
    """The slice's serving role label (prefill, decode, both); absent or unknown: both."""
    if label in ("prefill", "decode", "both"):
        return label
    if label is not None:
        log.warning(
            "EndpointSlice %s: role %r is not prefill, decode or both; using both",
            slice_name,
            label,
        )
    return "both"


class KubernetesApiDiscovery(Discovery):
    """What the discoveries that read the Kubernetes API share: the configured pools, and
    one API client, made on first use (none at all when discovery never runs)."""

    def __init__(self, cfg: DiscoveryConfig, static: list[BackendConfig], pools: set[str]) -> None:
        super().__init__(cfg, static)
        self.pools = pools
        self._api: KubernetesApi | None = None

    @property
    def api(self) -> KubernetesApi:
        if self._api is None:
            self._api = KubernetesApi(self.cfg)
        return self._api


class KubernetesDiscovery(KubernetesApiDiscovery):
    def __init__(self, cfg: DiscoveryConfig, static: list[BackendConfig], pools: set[str]) -> None:
        super().__init__(cfg, static, pools)
        self.slices: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.relists = 0

    def _publish_slices(self) -> None:
        found: dict[str, BackendConfig] = {}
        for key in sorted(self.slices):
            for b in slice_backends(self.cfg, self.slices[key], self.pools):
                found.setdefault(b.name, b)
        self.publish(list(found.values()))

    async def relist(self) -> None:
        data = await self.api.list_endpointslices(self.cfg.label_selector)
        self.slices = {
            s["metadata"]["name"]: s
            for s in data.get("items") or []
            if isinstance(s, dict) and isinstance(s.get("metadata"), dict)
        }
        self.resource_version = str((data.get("metadata") or {}).get("resourceVersion", ""))
        self.relists += 1
        self._publish_slices()

    async def first_list(self) -> None:
        await self.relist()

    async def _run(self) -> None:
        if not self.resource_version:
            await self.relist()
        try:
            await self._watch()
        except WatchExpired:
            log.info(
                "discovery: watch expired at resourceVersion %s; listing again",
                self.resource_version,
            )
            self.resource_version = ""

    async def _watch(self) -> None:
        timeout = max(1, int(self.cfg.interval_s))
        try:
            async for event in self.api.watch_endpointslices(
                self.cfg.label_selector, self.resource_version, timeout
            ):
                self._apply(event)
        except KubernetesApiError as exc:
            if exc.status == 410:
                raise WatchExpired from exc
            raise

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchExpired
            raise KubernetesApiError(
                int(obj.get("code") or 0), str(obj.get("message", "watch error"))
            )
        if meta.get("resourceVersion"):
            self.resource_version = str(meta["resourceVersion"])
        name = meta.get("name")
        if kind == "BOOKMARK" or not isinstance(name, str):
            return
        if kind == "DELETED":
            self.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
        self._publish_slices()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
