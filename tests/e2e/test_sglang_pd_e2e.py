"""SGLang's disaggregation protocol through the real gateway, on simulated SGLang servers in
prefill and decode mode (``kvroute engine --behaviour sglang --pd-protocol sglang``): the same
request to both at once with a bootstrap room, streaming and not, and the faults of each half.
After each: no room is left open on a prefill server, nothing runs, and the gateway holds no
reservation."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest

from tests.support.behaviours import engines, server_state, start
from tests.support.gateway import (
    all_reported,
    fleet_backends,
    gateway_cfg,
    run_gateway,
    wait_until,
)

FAST = {"speedup": 20, "block_size": 16, "pd_protocol": "sglang"}
PREFILL = {"pd_role": "prefill", "disaggregation_bootstrap_port": 0, **FAST}
DECODE = {"pd_role": "decode", **FAST}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 40


def backends(urls: dict[str, str]) -> list[dict[str, Any]]:
    """Names starting with p are prefill servers (their bootstrap port read from them), d decode."""
    out: list[dict[str, Any]] = []
    for name, url in urls.items():
        b: dict[str, Any] = {"name": name, "url": url, "kind": "sglang"}
        if name.startswith("p"):
            b.update(role="prefill", bootstrap_port=server_state(url)["bootstrap_port"])
        else:
            b["role"] = "decode"
        out.append(b)
    return out


def sglang_cfg(pd: list[dict[str, Any]], **sections: Any) -> Any:
    return gateway_cfg(pd, disaggregation={"protocol": "sglang"}, **sections)


def nothing_held(gw: str, urls: dict[str, str]) -> bool:
    """No room open on a prefill server, nothing running anywhere, no gateway reservation."""
    if any(server_state(u)["bootstrap_rooms"] for u in urls.values()):
        return False
    if any(
        sum(e["running"] + e["waiting"] for e in server_state(u)["engines"]) for u in urls.values()
    ):
        return False
    return all(
        b["overlay"]["reserved_tokens"] == 0 and b["overlay"]["inflight"] == 0
        for b in fleet_backends(gw)
    )


def ask(gw: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": max_tokens, **extra}
    return httpx.post(gw + "/v1/completions", json=body, timeout=30)


def metric(gw: str, line: str) -> bool:
    return line in httpx.get(gw + "/metrics", timeout=5).text


def test_both_halves_at_once_streaming_and_not() -> None:
    specs = [("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)]
    with engines(*specs) as urls:
        with run_gateway(sglang_cfg(backends(urls))) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            r = ask(gw)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-backend"] == "d1"
            assert r.headers["x-kvroute-prefill-backend"] == "p1"
            # The decode server's answer: all the tokens asked for, not the prefill's one.
            assert r.json()["usage"]["completion_tokens"] == 8
            body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 6, "stream": True}
            with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as s:
                assert s.status_code == 200
                assert s.headers["x-kvroute-prefill-backend"] == "p1"
                text = "".join(s.iter_text())
            # The decode server's stream, to its end (the prefill's one token would say "length" too
            # early only if it had been relayed: it never is, the decode's chunks are).
            assert '"finish_reason":"length"' in text and text.rstrip().endswith("data: [DONE]")
            assert text.count('"finish_reason":"length"') == 1
            # Both transfers were served through p1's bootstrap endpoint.
            wait_until(
                lambda: server_state(urls["p1"])["bootstrap_served"] == 2, what="rooms served"
            )
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
            assert metric(gw, 'kvroute_two_step_total{result="ok",step="prefill"} 2.0')
            assert metric(gw, 'kvroute_two_step_total{result="ok",step="decode"} 2.0')


def test_a_client_that_brings_its_own_room_is_routed_as_one_request_to_a_decode_server() -> None:
    # A PD router in front of kvroute: it sends the prefill server the request itself and
    # kvroute only the decode half, with its own fields.
    with engines(("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)) as urls:
        with run_gateway(sglang_cfg(backends(urls))) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            port = server_state(urls["p1"])["bootstrap_port"]
            fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}
            body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 4, **fields}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                prefill = pool.submit(
                    httpx.post, urls["p1"] + "/v1/completions", json=body, timeout=30
                )
                r = httpx.post(gw + "/v1/completions", json=body, timeout=30)
                assert prefill.result().status_code == 200
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-backend"] == "d1"
            assert "x-kvroute-prefill-backend" not in r.headers
            assert server_state(urls["p1"])["bootstrap_served"] == 1
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def test_a_request_without_a_room_is_refused_by_either_server() -> None:
    # What makes the gateway's fields necessary: SGLang's PD servers refuse such a request.
    with engines(("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)) as urls:
        for url in urls.values():
            body = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 400 and "without bootstrap room id" in r.text


def test_a_prefill_server_down_from_the_start_is_never_given_a_half() -> None:
    dead, dead_url = start("sglang", "p0", **PREFILL)
    dead_port = server_state(dead_url)["bootstrap_port"]
    dead.terminate()
    dead.wait(10)
    with engines(("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)) as urls:
        pd = backends(urls)
        # p0 sorts first by name, but never reported: it is not placed on at all.
        pd.append({"name": "p0", "url": dead_url, "kind": "sglang", "role": "prefill"})
        pd[-1]["bootstrap_port"] = dead_port
        with run_gateway(sglang_cfg(pd, health={"active": {"enabled": False}})) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            for _ in range(2):
                r = ask(gw)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-prefill-backend"] == "p1"
                assert r.headers["x-kvroute-prefill-attempts"] == "1"
                assert r.headers["x-kvroute-backend"] == "d1"
                # Both halves went at once after the decode reservation.
                assert "decode_sent;dur=" in r.headers["server-timing"]
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def test_a_prefill_server_killed_while_it_computes_moves_the_pair_to_another_one() -> None:
    # p0 computes slowly (seconds): it is killed with the pair's room open on it.
    slow = {**PREFILL, "speedup": 1, "prefill_tokens_per_s": 50}
    victim, victim_url = start("sglang", "p0", **slow)
    try:
        with engines(("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)) as urls:
            pd = backends({"p0": victim_url, **urls})
            with run_gateway(sglang_cfg(pd, health={"active": {"enabled": False}})) as gw:
                wait_until(lambda: all_reported(gw, 3), what="reports")
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    answer = pool.submit(ask, gw)
                    # p0 (first by name, no backlog anywhere) computes: d1 joined its room.
                    wait_until(lambda: _computing(victim_url), what="p0 computing")
                    victim.kill()
                    r = answer.result()
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-prefill-backend"] == "p1"
                assert r.headers["x-kvroute-prefill-attempts"] == "2"
                # The only decode server serves the second pair: it lost a transfer, no more.
                assert r.headers["x-kvroute-backend"] == "d1"
                assert server_state(urls["p1"])["bootstrap_served"] == 1
                wait_until(lambda: nothing_held(gw, urls), what="nothing held")
    finally:
        victim.kill()
        victim.wait(10)


def test_a_prefill_that_fails_first_cancels_its_decode_at_once() -> None:
    # p0 answers a 500 at once; d1, joined to p0's room, would wait there for its waiting timeout
    # (15 s here) unless the gateway cancels it.
    specs = [("sglang", "p0", PREFILL), ("sglang", "p1", PREFILL), ("sglang", "d1", DECODE)]
    with engines(*specs) as urls:
        with run_gateway(sglang_cfg(backends(urls))) as gw:
            wait_until(lambda: all_reported(gw, 3), what="reports")
            httpx.post(urls["p0"] + "/admin/disaggregation", json={"fail_prefills": 1})
            r = ask(gw)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-prefill-backend"] == "p1"
            assert r.headers["x-kvroute-prefill-attempts"] == "2"
            assert r.headers["x-kvroute-backend"] == "d1"
            metrics = httpx.get(gw + "/metrics", timeout=5).text
            # d1's first half was cancelled, never failed: no failure of d1 is counted.
            assert 'kvroute_attempts_total{backend="d1",result="ok"} 1.0' in metrics
            assert 'backend="d1",result="server_error"' not in metrics
            assert 'kvroute_two_step_total{result="failed",step="prefill"} 1.0' in metrics
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def _computing(url: str) -> bool:
    return bool(sum(e["running"] for e in server_state(url)["engines"]) > 0)


def test_every_prefill_server_down_fails_at_the_prefill_step() -> None:
    dead, dead_url = start("sglang", "p0", **PREFILL)
    dead.terminate()
    dead.wait(10)
    with engines(("sglang", "d1", DECODE)) as urls:
        pd = [*backends(urls), {"name": "p0", "url": dead_url, "kind": "sglang", "role": "prefill"}]
        with run_gateway(sglang_cfg(pd)) as gw:
            wait_until(lambda: all_reported(gw, 1), what="reports")
            r = ask(gw)
            # An SGLang decode server cannot compute the prompt alone: an outage, named.
            assert r.status_code == 503, r.text
            assert r.headers["x-kvroute-failed-step"] == "prefill"
            assert "x-kvroute-backend" not in r.headers or r.headers["x-kvroute-backend"] != "d1"
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def test_a_decode_server_out_of_memory_moves_the_pair_and_aborts_its_room() -> None:
    specs = [("sglang", "p1", PREFILL), ("sglang", "d1", DECODE), ("sglang", "d2", DECODE)]
    with engines(*specs) as urls:
        with run_gateway(sglang_cfg(backends(urls), retry={"max_attempts": 2})) as gw:
            wait_until(lambda: all_reported(gw, 3), what="reports")
            for name in ("d1", "d2"):
                httpx.post(urls[name] + "/admin/disaggregation", json={"refuse_decodes": 1})
            r = ask(gw)
            # Each decode server refused once, and two attempts is all the request may take.
            assert r.status_code == 503, r.text
            assert r.headers["x-kvroute-failed-step"] == "decode"
            assert r.headers["x-kvroute-failure-cause"] == "allocation_failure"
            # Each refused pair's prefill half was cancelled: its room aborted, nothing served.
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
            assert server_state(urls["p1"])["bootstrap_served"] == 0
            assert server_state(urls["p1"])["bootstrap_aborted"] == 2
            # The first refusal moved the pair; the second ended the request.
            assert metric(gw, 'kvroute_two_step_total{result="refused",step="decode"} 1.0')
            assert metric(gw, 'kvroute_two_step_total{result="failed",step="decode"} 1.0')
            # The refusals are over: the next request is served, by a pair.
            r = ask(gw)
            assert r.status_code == 200 and r.headers["x-kvroute-prefill-backend"] == "p1"
            wait_until(lambda: server_state(urls["p1"])["bootstrap_served"] == 1, what="served")


@pytest.mark.parametrize("slow", ["prefill", "decode"])
def test_a_client_that_leaves_while_the_pair_runs_leaves_nothing_behind(slow: str) -> None:
    # The slow half takes seconds (at speedup 1); the client gives up within it.
    prefill, decode = dict(PREFILL), dict(DECODE)
    if slow == "prefill":
        prefill.update(speedup=1, prefill_tokens_per_s=100)
    else:
        decode.update(speedup=1, decode_tokens_per_s=2)
    with engines(("sglang", "p1", prefill), ("sglang", "d1", decode)) as urls:
        with run_gateway(sglang_cfg(backends(urls))) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            with pytest.raises(httpx.ReadTimeout):
                body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 50}
                httpx.post(gw + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
            assert metric(
                gw, 'kvroute_two_step_total{result="client_disconnect",step="decode"} 1.0'
            )
            served = server_state(urls["p1"])["bootstrap_served"]
            # Left during the prefill: the room was aborted; during the decode: it was served.
            assert served == (0 if slow == "prefill" else 1)
