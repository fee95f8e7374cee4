"""The inference routes' one door (proxy.api.entry) answers like the full stack, on both roads.

A real gateway on uvicorn; the one injected fault is a bug in the walk (nothing else can
raise an unexpected exception there), to show it is still a 500 in OpenAI's format.
"""

from __future__ import annotations

import time

import httpx
import pytest

from proxy.api.gateway_app import GatewayApp
from proxy.api.limits import RequestGuard
from proxy.gateway.walk import Gateway
from tests.support.gateway import gateway_cfg, run_gateway, serve_app


def _cfg() -> object:
    return gateway_cfg([{"name": "a", "url": "http://127.0.0.1:1"}])


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_bug_in_the_walk_is_an_openai_500(monkeypatch: pytest.MonkeyPatch, lean: str) -> None:
    async def broken(self: Gateway, request: object, endpoint: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Gateway, "handle", broken)
    monkeypatch.setenv("KVROUTE_LEAN", lean)
    with run_gateway(_cfg()) as url:  # type: ignore[arg-type]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "a bug" not in r.text


def test_only_post_takes_the_inference_door_and_the_guard_is_the_apps_own() -> None:
    from proxy.api.app import create_app

    app = create_app(_cfg())  # type: ignore[arg-type]
    assert isinstance(app, GatewayApp)
    with serve_app(app, _cfg()) as url:  # type: ignore[arg-type]
        # The first request builds the stack: the guard found in it is the lean path's.
        assert httpx.get(url + "/v1/chat/completions").status_code == 405
        r = httpx.post(
            url + "/v1/completions", content=b"{", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        guard = app.guard
        assert isinstance(guard, RequestGuard)
        assert set(app.inference_routes) == {"/v1/chat/completions", "/v1/completions"}
        # Both requests went through that one guard (its concurrency count is the app's).
        # The guard counts a request out just after its answer's last write, which the
        # client may see first: wait (5 s, far above the microseconds this takes).
        deadline = time.monotonic() + 5.0
        while guard.inflight != 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert guard.inflight == 0


def test_the_openapi_document_keeps_the_inference_schemas() -> None:
    from proxy.api.app import create_app

    doc = create_app(_cfg()).openapi()  # type: ignore[arg-type]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    schema = chat["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["model", "messages"]
    assert "post" in doc["paths"]["/v1/completions"] and "/health" in doc["paths"]
