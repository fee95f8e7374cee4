"""Admin endpoints: drain, undrain and restart by hand, behind the admin key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadtest.workload import make_prompt
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

KEY = "s3cret-admin-key"
HTTP = httpx.Client(timeout=30)
HOOK = {"type": "http", "url": "{url}/admin/restart", "timeout_s": 5}
FAST = {
    "interval_s": 0.1,
    "drain_settle_s": 0.3,
    "min_interval_per_node_s": 0,
    "drain_timeout_s": 10,
    "healthy_timeout_s": 10,
}


def backend(engine: Any) -> dict[str, Any]:
    return {"name": engine.name, "url": engine.url, "kind": "contiguous"}


def wait_reports(url: str, n: int) -> None:
    wait_until(
        lambda: sum(1 for b in fleet_state(url)["backends"] if b["report"]) >= n,
        what="backend reports",
    )


def draining(url: str, name: str) -> bool:
    return bool(
        next(b for b in fleet_state(url)["backends"] if b["name"] == name)["overlay"]["draining"]
    )


def post(url: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return HTTP.post(url + path, headers=headers or {})


def test_admin_is_disabled_without_a_key(engine_factory: Callable[..., Any]) -> None:
    e = engine_factory(name="e1")
    with run_gateway(gateway_cfg([backend(e)])) as url:
        wait_reports(url, 1)
        for action in ("drain", "undrain", "restart"):
            r = post(url, f"/admin/backends/e1/{action}", {"authorization": f"Bearer {KEY}"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "admin_disabled"
        assert not draining(url, "e1")
        # Read-only operations endpoints stay open.
        assert HTTP.get(url + "/fleet/advice").json()["action"] == "none"
        assert HTTP.get(url + "/fleet/events").json() == {"events": []}


def test_admin_key_is_required_and_checked(engine_factory: Callable[..., Any]) -> None:
    a, b = engine_factory(name="node-a"), engine_factory(name="node-b")
    with run_gateway(gateway_cfg([backend(a), backend(b)], admin={"api_key": KEY})) as url:
        wait_reports(url, 2)
        missing = post(url, "/admin/backends/node-a/drain")
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith(
            "Bearer"
        )
        assert missing.json()["error"]["code"] == "admin_key_missing"
        assert (
            post(url, "/admin/backends/node-a/drain", {"authorization": f"Basic {KEY}"}).status_code
            == 401
        )
        assert (
            post(url, "/admin/backends/node-a/drain", {"authorization": "Bearer"}).status_code
            == 401
        )
        for bad in (
            {"authorization": "Bearer wrong"},
            {"x-admin-key": KEY[:-1]},
            {"x-admin-key": KEY + "x"},
        ):
            r = post(url, "/admin/backends/node-a/drain", bad)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_invalid"
        assert not draining(url, "node-a")

        ok = post(url, "/admin/backends/node-a/drain", {"authorization": f"bearer {KEY}"})
        assert ok.status_code == 200 and ok.json() == {"backend": "node-a", "draining": True}
        assert draining(url, "node-a")
        # Drained: no new requests go there.
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": make_prompt(50)}],
            "max_tokens": 8,
        }
        served = {
            HTTP.post(url + "/v1/chat/completions", json=body).headers["x-kvroute-backend"]
            for _ in range(6)
        }
        assert served == {"node-b"}
        assert (
            post(url, "/admin/backends/node-a/undrain", {"x-admin-key": KEY}).json()["draining"]
            is False
        )
        assert not draining(url, "node-a")

        missing_node = post(url, "/admin/backends/nope/drain", {"x-admin-key": KEY})
        assert missing_node.status_code == 404
        no_hook = post(url, "/admin/backends/node-a/restart", {"x-admin-key": KEY})
        assert (
            no_hook.status_code == 409 and "no restart hook" in no_hook.json()["error"]["message"]
        )

        kinds = [
            (e["type"], e["backend"]) for e in HTTP.get(url + "/fleet/events").json()["events"]
        ]
        assert kinds == [("undrain", "node-a"), ("drain", "node-a")]
        assert HTTP.get(url + "/fleet/events", params={"limit": "0"}).status_code == 400
        assert HTTP.get(url + "/fleet/events", params={"limit": "x"}).status_code == 400
    assert a.state()["restarts"] == 0


def test_requests_sent_right_after_a_drain_avoid_the_node(
    engine_factory: Callable[..., Any],
) -> None:
    # Requests may rank on a fleet view up to a quarter second old while the next read runs
    # (proxy.state.fleet_cache); a drain answered here is in the very next request's view.
    a, b = engine_factory(name="node-a"), engine_factory(name="node-b")
    with run_gateway(gateway_cfg([backend(a), backend(b)], admin={"api_key": KEY})) as url:
        wait_reports(url, 2)
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": make_prompt(50)}],
            "max_tokens": 8,
        }

        def served_by() -> str:
            r = HTTP.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200
            return r.headers["x-kvroute-backend"]

        before: set[str] = set()
        for _ in range(4):
            before |= {served_by() for _ in range(4)}  # a view read just now, both nodes up
            assert post(url, "/admin/backends/node-a/drain", {"x-admin-key": KEY}).is_success
            assert {served_by() for _ in range(4)} == {"node-b"}
            assert post(url, "/admin/backends/node-a/undrain", {"x-admin-key": KEY}).is_success
        assert "node-a" in before  # it would have been chosen, were it not drained


def test_manual_restart_through_the_hook(engine_factory: Callable[..., Any]) -> None:
    a, b = engine_factory(name="node-a"), engine_factory(name="node-b")
    a.fragment(4_000)
    cfg = gateway_cfg(
        [backend(a), backend(b)], admin={"api_key": KEY}, maintenance={**FAST, "hook": HOOK}
    )
    with run_gateway(cfg) as url:
        wait_reports(url, 2)
        auth = {"authorization": f"Bearer {KEY}"}
        started = post(url, "/admin/backends/node-a/restart", auth)
        assert started.status_code == 202, started.text
        assert started.json()["backend"] == "node-a" and started.json()["restart_id"]
        again = post(url, "/admin/backends/node-a/restart", auth)
        assert (
            again.status_code == 409
            and "already being restarted" in again.json()["error"]["message"]
        )
        other = post(url, "/admin/backends/node-b/restart", auth)
        assert (
            other.status_code == 409
            and "max_concurrent_restarts is 1" in other.json()["error"]["message"]
        )
        early = post(url, "/admin/backends/node-a/undrain", auth)
        assert early.status_code == 409  # it returns to service by itself

        def done() -> bool:
            return any(
                e["type"] == "restart_done"
                for e in HTTP.get(url + "/fleet/events").json()["events"]
            )

        wait_until(done, timeout_s=20, what="restart_done")
        ev = {
            e["type"]: e
            for e in HTTP.get(url + "/fleet/events", params={"backend": "node-a"}).json()["events"]
        }
        assert (
            ev["restart_done"]["reason"] == "manual"
            and ev["restart_done"]["restart_id"] == started.json()["restart_id"]
        )
        assert not draining(url, "node-a")
        assert (
            'kvroute_restarts_total{backend="node-a",reason="manual"} 1.0'
            in HTTP.get(url + "/metrics").text
        )
    st = a.state()
    assert st["restarts"] == 1 and st["free_tokens"] == st["capacity_tokens"]
    assert b.state()["restarts"] == 0


def test_manual_restart_refuses_to_take_out_the_last_node_unless_forced(
    engine_factory: Callable[..., Any],
) -> None:
    e = engine_factory(name="only")
    cfg = gateway_cfg([backend(e)], admin={"api_key": KEY}, maintenance={**FAST, "hook": HOOK})
    with run_gateway(cfg) as url:
        wait_reports(url, 1)
        refused = post(url, "/admin/backends/only/restart", {"x-admin-key": KEY})
        assert (
            refused.status_code == 409
            and "no other healthy node" in refused.json()["error"]["message"]
        )
        assert e.state()["restarts"] == 0
        forced = post(url, "/admin/backends/only/restart?force=true", {"x-admin-key": KEY})
        assert forced.status_code == 202
        wait_until(lambda: e.state()["restarts"] == 1, what="forced restart")


@pytest.mark.parametrize("header", ["authorization", "x-admin-key"])
def test_key_comparison_handles_non_ascii_input(
    engine_factory: Callable[..., Any], header: str
) -> None:
    e = engine_factory(name="e1")
    with run_gateway(gateway_cfg([backend(e)], admin={"api_key": KEY})) as url:
        value = ("Bearer " if header == "authorization" else "") + "clé-\u00e9"
        r = HTTP.post(url + "/admin/backends/e1/drain", headers={header: value.encode("utf-8")})
        assert r.status_code == 403
