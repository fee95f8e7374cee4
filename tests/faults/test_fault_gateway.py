"""Gateway fault handling that needs a backend the simulated engine cannot imitate.

A tiny real HTTP backend (aiohttp, own thread and loop) answers as told: busy with
Retry-After, 500s, headers too late, a stream that stalls or runs too long, odd headers.
The gateway is the real app on uvicorn; no collector runs, so backends are routed by
length only, in a fixed round-robin order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.faults.harness import judge_json, judge_sse
from tests.support.gateway import gateway_cfg, run_gateway
from tests.support.threaded_app import ThreadedApp

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# The timeouts test: every margin at least 5x. Events 0.1 s apart against a 1 s idle limit;
# a stream of 10 s (it cannot end sooner: it sleeps) against a 3 s total limit; headers or
# events withheld for 10 s against the 0.5 s / 1 s limits they must trip.
TTFB_S, IDLE_S, TOTAL_S = 0.5, 1.0, 3.0
LONG_STREAM_GAP_S, LONG_STREAM_EVENTS = 0.1, 100


class TinyBackend(ThreadedApp):
    def __init__(self, name: str, mode: str = "ok") -> None:
        super().__init__()
        self.name = name
        self.mode = mode
        self.hits = 0
        self.last_headers: dict[str, str] = {}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.last_headers = dict(request.headers)
        body = orjson.loads(await request.read())
        stream = bool(body.get("stream"))
        mode = self.mode
        if mode == "busy":
            err = {
                "error": {
                    "message": "busy, come back later",
                    "type": "overloaded",
                    "param": None,
                    "code": "overloaded",
                }
            }
            return web.json_response(err, status=503, headers={"Retry-After": "30"})
        if mode == "error500":
            return web.Response(status=500, text="Internal Server Error")
        if mode == "slow_headers":
            await asyncio.sleep(10)
        if mode == "slow_ok":
            await asyncio.sleep(0.4)
        extra = (
            {
                "Connection": "x-secret",
                "X-Secret": "1",
                "Proxy-Authenticate": "Basic",
                "X-Visible": "yes",
            }
            if mode == "hop"
            else {}
        )
        if not stream:
            done = {
                "id": "c1",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
            }
            return web.json_response(done, headers=extra)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **extra})
        await resp.prepare(request)
        event = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
        await resp.write(event)
        if mode == "stall_stream":
            await asyncio.sleep(10)
        n = LONG_STREAM_EVENTS if mode == "long_stream" else 2
        for _ in range(n):
            if mode == "long_stream":
                await asyncio.sleep(LONG_STREAM_GAP_S)
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def start(self) -> TinyBackend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        self.serve(app)
        return self


@pytest.fixture
def backends() -> Iterator[Callable[..., TinyBackend]]:
    started: list[TinyBackend] = []

    def make(name: str, mode: str = "ok") -> TinyBackend:
        b = TinyBackend(name, mode).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


def cfg_for(bs: list[TinyBackend], **sections: Any) -> Any:
    sections.setdefault("routing", {}).setdefault("policy", "round_robin")
    sections.setdefault("health", {}).setdefault("active", {"enabled": False})
    return gateway_cfg([{"name": b.name, "url": b.url} for b in bs], **sections)


def post(url: str, stream: bool = False, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={**BODY, "stream": stream},
        headers=headers or {},
        timeout=30,
    )


def test_retry_after_cools_the_backend_down(backends: Callable[..., TinyBackend]) -> None:
    busy, ok = backends("a-busy", "busy"), backends("b-ok")
    with run_gateway(cfg_for([busy, ok]), run_collector=False) as url:
        codes = [post(url).status_code for _ in range(6)]
        assert codes == [200] * 6  # the busy answer went to the other backend
        assert busy.hits == 1  # ... and Retry-After kept every later request away from it
        node = {b["name"]: b for b in httpx.get(url + "/fleet").json()["backends"]}["a-busy"]
        assert (
            node["overlay"]["cooldown_until"] > time.time() + 20
        )  # shared with other replicas via the store


def test_retry_budget_bounds_retries(backends: Callable[..., TinyBackend]) -> None:
    bad, ok = backends("a-bad", "error500"), backends("b-ok")
    no_budget = {"budget_percent": 0, "budget_min_concurrency": 0}
    with run_gateway(cfg_for([bad, ok], retry=no_budget), run_collector=False) as url:
        rs = [post(url) for _ in range(4)]
        failed = [r for r in rs if r.status_code != 200]
        assert failed, "with no retry budget, the 500 must reach the client"
        for r in failed:
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_server_error"
        assert (
            f"kvroute_retry_budget_exhausted_total {float(len(failed))}"
            in httpx.get(url + "/metrics").text
        )
    with run_gateway(cfg_for([bad, ok]), run_collector=False) as url:
        assert [post(url).status_code for _ in range(4)] == [200] * 4  # the default budget retries


def test_retries_over_the_budget_wait_for_a_slot_instead_of_failing(
    backends: Callable[..., TinyBackend],
) -> None:
    """A backend that fails all it holds at once: every request is still served elsewhere.

    One retry slot, and each retry holds it until the other backend's answer starts (0.4 s):
    the retries over the cap wait for the slot (within ``queue.max_wait_s``) instead of
    answering the failure, and the cap still holds.
    """
    bad, ok = backends("a-bad", "error500"), backends("b-ok", "slow_ok")
    one_slot = {"budget_percent": 0, "budget_min_concurrency": 1}
    cfg = cfg_for([bad, ok], retry=one_slot, queue={"max_wait_s": 10.0})
    with run_gateway(cfg, run_collector=False) as url:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(url), range(8)))
            codes = [r.status_code for r in answers]
        assert codes == [200] * 8
        assert bad.hits >= 2  # several retries wanted the one slot at once
        text = httpx.get(url + "/metrics").text
        assert "kvroute_retry_budget_exhausted_total 0.0" in text


def test_timeouts_are_each_answered_clearly(backends: Callable[..., TinyBackend]) -> None:
    slow = backends("slow", "slow_headers")
    upstream = {"ttfb_timeout_s": TTFB_S, "idle_timeout_s": IDLE_S, "total_timeout_s": TOTAL_S}
    with run_gateway(
        cfg_for([slow], upstream=upstream, retry={"max_attempts": 1}), run_collector=False
    ) as url:
        r = post(url)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        r = post(url, stream=True)  # no first event in time either: still a 504, nothing was sent
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        slow.mode = "stall_stream"
        r = post(url, stream=True)  # first event relayed, then silence: a final SSE error event
        assert r.status_code == 200 and judge_sse(r.content) == (
            "failed",
            "stream:upstream_idle_timeout",
        )
        slow.mode = "long_stream"  # events keep coming, but for longer than the total limit
        r = post(url, stream=True)
        assert r.status_code == 200 and judge_sse(r.content) == (
            "failed",
            "stream:upstream_total_timeout",
        )
        slow.mode = "ok"
        assert post(url).status_code == 200


def test_unreachable_backend_is_a_502_in_openai_format(
    backends: Callable[..., TinyBackend],
) -> None:
    gone = backends("gone")
    gone.stop()
    with run_gateway(cfg_for([gone], retry={"max_attempts": 1}), run_collector=False) as url:
        r = post(url)
        assert judge_json(r.status_code, r.content) == ("failed", "502:upstream_unavailable")


def test_client_api_keys(backends: Callable[..., TinyBackend]) -> None:
    ok = backends("ok")
    with run_gateway(
        cfg_for([ok], auth={"api_keys": ["key-one", "key-two"]}), run_collector=False
    ) as url:
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": "Basic a2V5LW9uZQ=="},
        ):
            r = post(url, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert ok.hits == 0
        assert post(url, headers={"Authorization": "Bearer key-two"}).status_code == 200
        # The gateway's own key is not the backend's business: it is not forwarded.
        assert "Authorization" not in ok.last_headers
        assert httpx.get(url + "/health").status_code != 401  # only /v1 needs a key
        assert httpx.get(url + "/v1/models").status_code == 401


def test_concurrency_limit_answers_429_with_retry_after(
    backends: Callable[..., TinyBackend],
) -> None:
    slow = backends("slow", "long_stream")
    with run_gateway(
        cfg_for([slow], limits={"max_concurrent_requests": 2}), run_collector=False
    ) as url:
        with httpx.Client(timeout=30) as c:
            s1 = c.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True})
            s2 = c.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True})
            with s1 as r1, s2 as r2:
                assert r1.status_code == r2.status_code == 200
                r3 = post(url)
                assert r3.status_code == 429 and r3.headers["retry-after"] == "1"
                assert r3.json()["error"]["code"] == "too_many_concurrent_requests"
                r1.read()
                r2.read()
        assert post(url).status_code == 200  # the slots came back


def test_hop_by_hop_stripped_both_ways_and_authorization_never_logged(
    backends: Callable[..., TinyBackend], caplog: pytest.LogCaptureFixture
) -> None:
    hop = backends("hop", "hop")
    secret = "sk-very-secret-0123"
    # The client's Authorization goes upstream only when configured to (the default: never).
    forwarding = cfg_for([hop], auth={"forward_client_authorization": "when_no_backend_key"})
    with caplog.at_level(logging.DEBUG), run_gateway(forwarding, run_collector=False) as url:
        sent = {
            "Authorization": f"Bearer {secret}",
            "Connection": "keep-alive, x-hop",
            "X-Hop": "1",
            "TE": "trailers",
            "Proxy-Authorization": "Basic eA==",
            "Host": "client.example",
            "X-Custom": "kept",
        }
        r = post(url, headers=sent)
        assert r.status_code == 200
        seen = {k.lower(): v for k, v in hop.last_headers.items()}
        assert seen["authorization"] == f"Bearer {secret}" and seen["x-custom"] == "kept"
        assert "x-hop" not in seen and "te" not in seen and "proxy-authorization" not in seen
        assert seen["host"] == f"127.0.0.1:{hop.port}"  # the client's Host is not forwarded
        assert "x-secret" not in r.headers and "proxy-authenticate" not in r.headers
        assert r.headers["x-visible"] == "yes"
        hop.mode = "error500"
        post(url, headers=sent)  # a failure path logs too
    assert secret not in caplog.text
