"""Sizing through the real gateway: tools and n in the demand; huge fields never stall the loop.

The gateway runs on uvicorn in a thread, the engines are simulated engines, the clients are
httpx and the ``openai`` package. Demand is read from the ``x-kvroute-demand-tokens`` header
and compared with counts computed here with tiktoken directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from proxy.core.tokens import count_text
from tests.core.test_sizing import MSG, PRIME, TOOL, TOOLS, js, t
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until


def _backend(engine: Any) -> dict[str, Any]:
    return {"name": engine.name, "url": engine.url, "kind": "contiguous"}


def _ready(url: str) -> None:
    wait_until(lambda: any(b["report"] for b in fleet_state(url)["backends"]), what="report")


def test_tools_and_n_are_in_the_demand(engine_factory: Callable[..., Any]) -> None:
    engine = engine_factory(name="e1")
    with run_gateway(gateway_cfg([_backend(engine)])) as url:
        _ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        msgs: Any = [{"role": "user", "content": "weather in Paris?"}]
        prompt = PRIME + MSG + t("user") + t("weather in Paris?")
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=msgs, tools=TOOLS, max_tokens=8
        )
        tools = sum(t(js(x)) + TOOL for x in TOOLS)
        assert int(raw.headers["x-kvroute-demand-tokens"]) == prompt + tools + 8
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=msgs, n=3, max_tokens=8
        )
        assert int(raw.headers["x-kvroute-demand-tokens"]) == prompt + 3 * 8
        # No max_tokens: the default (256) for each of the n sequences.
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=msgs, n=2
        )
        assert int(raw.headers["x-kvroute-demand-tokens"]) == prompt + 2 * 256
        # Two completions prompts are two sequences, each with its own output.
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "sim-model", "prompt": ["alpha beta", "gamma"], "max_tokens": 5},
            timeout=30,
        )
        assert r.status_code == 200
        assert int(r.headers["x-kvroute-demand-tokens"]) == t("alpha beta") + t("gamma") + 10


def _worst_health_gap(url: str, attack: Callable[[], httpx.Response]) -> tuple[float, int]:
    """Longest /health round trip while ``attack`` runs, and the attack's status."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(attack()))
    worst = 0.0
    with httpx.Client(timeout=30) as probe:
        probe.get(url + "/health")
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            assert probe.get(url + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
        thread.join()
    return worst, result[0].status_code


def test_huge_fields_do_not_hold_the_event_loop(engine_factory: Callable[..., Any]) -> None:
    engine = engine_factory(name="e1")
    name = "x" * 3_900_000
    # Baseline, same run: what counting the name inline would freeze the loop for.
    t0 = time.perf_counter()
    count_text(name)
    inline_s = time.perf_counter() - t0
    schema = {f"p{i}": {"type": "string", "description": "word " * 40} for i in range(15_000)}
    big_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    many_tools = [
        {"type": "function", "function": {"name": f"t{i}", "description": "a b c " * 100}}
        for i in range(4_000)
    ]
    attacks = {
        "3.9 MB name": {"messages": [{"role": "user", "content": "hi", "name": name}]},
        "3.6 MB tool schema": {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [big_tool],
        },
        "2.5 MB over 4000 tools": {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": many_tools,
        },
    }
    with run_gateway(gateway_cfg([_backend(engine)])) as url:
        _ready(url)
        with httpx.Client(timeout=60) as c:
            for what, body in attacks.items():

                def attack(body: dict[str, Any] = body) -> httpx.Response:
                    return c.post(url + "/v1/chat/completions", json={"model": "m", **body})

                worst, status = _worst_health_gap(url, attack)
                # Sized, then refused as too big for the fleet: an answer, not a stall.
                assert status == 400, what
                # Counted on the loop, a probe would wait about the whole count (inline_s).
                # Half of it tells the two apart; a fifth did not on a starved box: under
                # two busy loops one probe waited 0.42 s against 1.95 / 5 = 0.39 (the OS's
                # scheduling, the same attacks 7-19 ms on a quiet box).
                assert worst < inline_s / 2, (what, worst, inline_s)
