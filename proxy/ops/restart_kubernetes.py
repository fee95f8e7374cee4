"""The ``kubernetes`` restart hook: delete the fragmented pod, wait for its replacement.

A fragmented inference server is healed by a fresh process; on Kubernetes the way to get one
is to delete the pod and let its ReplicaSet (or StatefulSet) start another. The maintenance
loop has already drained the node when this runs. Guard rails, since RBAC can grant pod
deletion only namespace-wide:

- the pod is read first and deleted only if its labels match ``pod_selector``;
- the delete carries the pod's uid as a precondition, so a namesake created meanwhile (a
  StatefulSet reuses names) is never deleted by mistake;
- then the hook waits (``timeout_s``) for a matching pod that did not exist before to be
  Running and Ready, and names it in ``replaced_by`` (for a StatefulSet: the same name,
  with a new uid). The maintenance loop then waits for that backend's fresh report.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from proxy.config import KubernetesApiConfig
from proxy.errors import KubernetesApiError
from proxy.ops.restart_contract import HookResult, RestartHook
from proxy.upstream.kubernetes_api import KubernetesApi, labels_match

POLL_S = 0.5


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _uid(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


class KubernetesHook(RestartHook):
    kind = "kubernetes"

    def __init__(
        self, api: KubernetesApiConfig, pod_selector: str, timeout_s: float, poll_s: float = POLL_S
    ) -> None:
        self.api_cfg = api
        self.pod_selector = pod_selector
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._api: KubernetesApi | None = None

    @property
    def api(self) -> KubernetesApi:
        if self._api is None:
            self._api = KubernetesApi(self.api_cfg)
        return self._api

    async def restart(self, name: str, url: str) -> HookResult:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._restart(name, t0)
        except TimeoutError:
            return HookResult(
                False,
                f"pod {name}: no ready replacement within {self.timeout_s:g}s",
                time.monotonic() - t0,
            )
        except KubernetesApiError as exc:
            return HookResult(
                False,
                f"pod {name}: {exc}",
                time.monotonic() - t0,
                # The API error may name the API server's URL: the open event log gets the kind.
                summary=f"pod {name}: {type(exc).__name__}",
            )

    async def _restart(self, name: str, t0: float) -> HookResult:
        pod = await self.api.get_pod(name)
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not labels_match(labels, self.pod_selector):
            return HookResult(
                False,
                f"pod {name} does not match pod_selector {self.pod_selector!r}: not deleting it",
                time.monotonic() - t0,
            )
        # Pods that exist now (by uid) are not replacements, whatever their state.
        before = {_uid(p) for p in await self.api.list_pods(self.pod_selector)}
        await self.api.delete_pod(name, _uid(pod))
        while True:
            for p in await self.api.list_pods(self.pod_selector):
                if _uid(p) not in before and _ready(p):
                    new = str(p["metadata"]["name"])
                    return HookResult(
                        True,
                        f"deleted pod {name}; replacement {new} is ready",
                        time.monotonic() - t0,
                        replaced_by=new,
                    )
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
