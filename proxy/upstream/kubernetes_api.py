"""A small Kubernetes API client: the few calls kvroute makes, with in-cluster credentials.

Discovery lists and watches EndpointSlices, or reads an InferencePool and lists its pods; the
``kubernetes`` restart hook reads, lists and deletes pods. A full client library would bring
far more than these six calls need, so this
speaks the documented REST shapes directly (``/apis/discovery.k8s.io/v1/...``,
``/api/v1/namespaces/{ns}/pods``), with:

- the service-account token re-read from its file before each request (kubelet rotates
  projected tokens; a cached token would expire after an hour),
- the cluster CA from the mounted ``ca.crt`` (TLS verification always on when it exists),
- a timeout on every call; a watch is bounded by ``timeoutSeconds`` plus a margin.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from proxy.config import SERVICE_ACCOUNT_DIR, KubernetesApiConfig
from proxy.errors import KubernetesApiError

ENDPOINTSLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
PODS = "/api/v1/namespaces/{ns}/pods"
INFERENCE_POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
CALL_TIMEOUT_S = 10.0


def own_namespace(default: str = "default") -> str:
    """The namespace of the pod we run in (mounted with the service account), or ``default``."""
    try:
        return Path(SERVICE_ACCOUNT_DIR, "namespace").read_text(encoding="utf-8").strip() or default
    except OSError:
        return default


class KubernetesApi:
    """Async calls against one API server; create inside the event loop, ``close()`` when done."""

    def __init__(self, cfg: KubernetesApiConfig) -> None:
        self.namespace = cfg.namespace or own_namespace()
        self._token_path = Path(cfg.token_path) if cfg.token_path else None
        verify: ssl.SSLContext | bool = True
        if cfg.ca_path and Path(cfg.ca_path).exists():
            verify = ssl.create_default_context(cafile=cfg.ca_path)
        # trust_env=False: the API server is reached directly, never through an environment proxy.
        self._http = httpx.AsyncClient(
            base_url=cfg.api_url.rstrip("/"),
            verify=verify,
            trust_env=False,
            timeout=httpx.Timeout(CALL_TIMEOUT_S),
        )

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_path is not None:
            with contextlib.suppress(OSError):
                token = self._token_path.read_text(encoding="utf-8").strip()
                if token:
                    headers["Authorization"] = f"Bearer {token}"
        return headers

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            headers = self._headers()
            if "content" in kw:
                headers["Content-Type"] = "application/json"
            resp = await self._http.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as exc:
            raise KubernetesApiError(
                0, f"kubernetes api {method} {path}: {type(exc).__name__}: {exc}"
            ) from exc
        if not 200 <= resp.status_code < 300:
            raise KubernetesApiError(resp.status_code, _message(resp.content))
        data = orjson.loads(resp.content) if resp.content else {}
        return data if isinstance(data, dict) else {}

    # --- EndpointSlices ---
    async def list_endpointslices(self, label_selector: str) -> dict[str, Any]:
        path = ENDPOINTSLICES.format(ns=quote(self.namespace))
        return await self._json("GET", path, params=_selector(label_selector))

    async def watch_endpointslices(
        self, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) until the server ends the watch."""
        path = ENDPOINTSLICES.format(ns=quote(self.namespace))
        params = {
            **_selector(label_selector),
            "watch": "1",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        timeout = httpx.Timeout(CALL_TIMEOUT_S, read=timeout_s + CALL_TIMEOUT_S)
        try:
            async with self._http.stream(
                "GET", path, params=params, headers=self._headers(), timeout=timeout
            ) as resp:
                if resp.status_code != 200:
                    raise KubernetesApiError(resp.status_code, _message(await resp.aread()))
                async for line in resp.aiter_lines():
                    if line.strip():
                        event = orjson.loads(line)
                        if isinstance(event, dict):
                            yield event
        except httpx.HTTPError as exc:
            raise KubernetesApiError(
                0, f"kubernetes api watch: {type(exc).__name__}: {exc}"
            ) from exc

    # --- pods ---
    async def get_pod(self, name: str) -> dict[str, Any]:
        return await self._json("GET", f"{PODS.format(ns=quote(self.namespace))}/{quote(name)}")

    async def list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        data = await self._json(
            "GET", PODS.format(ns=quote(self.namespace)), params=_selector(label_selector)
        )
        items = data.get("items")
        return [p for p in items if isinstance(p, dict)] if isinstance(items, list) else []

    async def delete_pod(self, name: str, uid: str) -> dict[str, Any]:
        """Delete exactly the pod we inspected: the uid precondition refuses a namesake."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        path = f"{PODS.format(ns=quote(self.namespace))}/{quote(name)}"
        return await self._json("DELETE", path, content=orjson.dumps(body))

    # --- inference pools (Gateway API Inference Extension) ---
    async def get_inference_pool(self, name: str) -> dict[str, Any]:
        path = f"{INFERENCE_POOLS.format(ns=quote(self.namespace))}/{quote(name)}"
        return await self._json("GET", path)

    async def close(self) -> None:
        await self._http.aclose()


def _selector(label_selector: str) -> dict[str, str]:
    return {"labelSelector": label_selector} if label_selector else {}


def _message(raw: bytes) -> str:
    """A Status object's message, else the start of the body."""
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            return str(data["message"])
    return raw[:300].decode("utf-8", errors="replace")


def labels_match(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c!=d,e``, also ``==``): what the hook checks itself.

    Set-based forms (``in``, ``notin``) are refused by the config check rather than guessed at.
    """
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True
