"""A small Kubernetes API server for tests: the documented REST shapes kvroute uses.

No API server can run on the test machines, so this serves, on 127.0.0.1 in a thread:

- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` list (``EndpointSliceList``
  with ``metadata.resourceVersion``) and ``?watch=1&resourceVersion=RV`` watch: one JSON
  event per line (``ADDED``/``MODIFIED``/``DELETED``), held open until ``timeoutSeconds``;
  a resourceVersion older than the compaction point gets the API server's answer, an
  ``ERROR`` event carrying a ``Status`` with ``code: 410`` (reason ``Expired``);
- ``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}``;
- ``GET``/``DELETE /api/v1/namespaces/{ns}/pods/{name}`` (DELETE honours
  ``preconditions.uid`` with 409 Conflict) and ``GET .../pods?labelSelector=``;
- equality label selectors, and ``Authorization: Bearer <token>`` required (401 without).

Tests change the cluster through ``put_slice``/``delete_slice``/``add_pod``; ``on_delete``
lets a test play the ReplicaSet (start a replacement pod when one is deleted).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from loadtest.local_fleet import free_port
from proxy.upstream.kubernetes_api import labels_match

TOKEN = "test-token"


def endpoint_slice(
    name: str,
    endpoints: list[tuple[str, str, bool | None]],
    *,
    port: int,
    port_name: str = "http",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice: endpoints as (pod name, IPv4 address, ready: True/False/None=absent)."""
    eps = []
    for pod, ip, ready in endpoints:
        ep: dict[str, Any] = {
            "addresses": [ip],
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns"},
        }
        if ready is not None:
            ep["conditions"] = {"ready": ready, "serving": ready, "terminating": False}
        eps.append(ep)
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "ns", "labels": dict(labels or {})},
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def pod(
    name: str, labels: dict[str, str], uid: str | None = None, ready: bool = True
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid or f"uid-{name}",
            "labels": labels,
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeApi:
    def __init__(self) -> None:
        self.port = free_port()
        self._lock = threading.Lock()
        self.rv = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.inference_pools: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted_below = 0
        self.requests: list[tuple[str, str]] = []
        self.deleted: list[str] = []
        self.on_delete: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- the cluster, changed by tests --------------------------------------------------
    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj = orjson.loads(orjson.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def put_slice(self, obj: dict[str, Any]) -> None:
        with self._lock:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.slices else "ADDED"
            obj = self._bump(obj)
            self.slices[name] = obj
            self.events.append((self.rv, kind, obj))

    def delete_slice(self, name: str) -> None:
        with self._lock:
            obj = self._bump(self.slices.pop(name))
            self.events.append((self.rv, "DELETED", obj))

    def compact(self) -> None:
        """Forget the event history: watches from older versions get 410 Gone."""
        with self._lock:
            self.compacted_below = self.rv + 1
            self.events.clear()

    def add_pod(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self.pods[obj["metadata"]["name"]] = self._bump(obj)

    def put_inference_pool(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self.inference_pools[obj["metadata"]["name"]] = self._bump(obj)

    # --- HTTP ---------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> web.Response | None:
        self.requests.append((request.method, request.path_qs))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        return None

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        denied = self._auth(request)
        if denied is not None:
            return denied
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, selector)
        with self._lock:
            items = [
                s for s in self.slices.values() if labels_match(s["metadata"]["labels"], selector)
            ]
            rv = str(self.rv)
        return web.json_response(
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or 30)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.compacted_below:
            status = _status(
                410, "Expired", f"too old resource version: {since} ({self.compacted_below})"
            )
            await resp.write(orjson.dumps({"type": "ERROR", "object": status}) + b"\n")
            return resp
        deadline = time.monotonic() + timeout
        sent = since
        while time.monotonic() < deadline and not self._closing:
            with self._lock:
                if sent < self.compacted_below:
                    status = _status(410, "Expired", "too old resource version")
                    batch = [(self.rv, "ERROR", status)]
                else:
                    batch = [e for e in self.events if e[0] > sent]
            for rv, kind, obj in batch:
                sent = rv
                if kind != "ERROR" and not labels_match(obj["metadata"]["labels"], selector):
                    continue
                await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")
                if kind == "ERROR":
                    return resp
            await asyncio.sleep(0.02)
        return resp

    async def _pod(self, request: web.Request) -> web.Response:
        denied = self._auth(request)
        if denied is not None:
            return denied
        name = request.match_info["name"]
        with self._lock:
            obj = self.pods.get(name)
        if obj is None:
            return web.json_response(
                _status(404, "NotFound", f'pods "{name}" not found'), status=404
            )
        if request.method == "GET":
            return web.json_response(obj)
        body = await request.json() if request.can_read_body else {}
        want = ((body or {}).get("preconditions") or {}).get("uid")
        if want is not None and want != obj["metadata"]["uid"]:
            return web.json_response(
                _status(409, "Conflict", "Precondition failed: UID in precondition"), status=409
            )
        with self._lock:
            self.pods.pop(name, None)
            self.deleted.append(name)
        if self.on_delete is not None:
            self.on_delete(name)
        return web.json_response(obj)

    async def _inference_pool(self, request: web.Request) -> web.Response:
        denied = self._auth(request)
        if denied is not None:
            return denied
        name = request.match_info["name"]
        with self._lock:
            obj = self.inference_pools.get(name)
        if obj is None:
            message = f'inferencepools.inference.networking.k8s.io "{name}" not found'
            return web.json_response(_status(404, "NotFound", message), status=404)
        return web.json_response(obj)

    async def _pods(self, request: web.Request) -> web.Response:
        denied = self._auth(request)
        if denied is not None:
            return denied
        selector = request.query.get("labelSelector", "")
        with self._lock:
            items = [
                p for p in self.pods.values() if labels_match(p["metadata"]["labels"], selector)
            ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        )

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._slices)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
            self._inference_pool,
        )
        app.router.add_route("GET", "/api/v1/namespaces/{ns}/pods/{name}", self._pod)
        app.router.add_route("DELETE", "/api/v1/namespaces/{ns}/pods/{name}", self._pod)
        started = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        assert started.wait(10), "fake kubernetes api did not start"
        return self

    def stop(self) -> None:
        self._closing = True
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
