"""Gateway + simulated vLLM engines that publish KV-cache events: affinity follows the events.

A client that bypasses the gateway (another gateway, a batch job) fills an engine's prefix
cache; the gateway never saw it, so only the engine's events can tell. The same prompt sent
through the gateway then lands where it is cached.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx

from tests.support.behaviours import engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until
from tests.support.kv_events import free_ports

FAST = {"speedup": 20, "block_size": 16, "capacity_tokens": 200_000}
CASES = [
    ("b", "/v1/completions"),
    ("a", "/v1/completions"),
    ("b", "/v1/chat/completions"),
    ("a", "/v1/chat/completions"),
]


def document(seed: int, words: int = 2_500) -> str:
    rng = random.Random(seed)
    vocab = ["kv", "cache", "route", "engine", "token", "block", "prefix", "event", "gpu", "rank"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(words))


def events_flag(base: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{base}",
            "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
        }
    )


def fleet(gw: str) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw + "/fleet", timeout=5).json()["backends"]}


def blocks_on(gw: str, name: str) -> int:
    return sum(r["index_blocks"] for r in fleet(gw)[name].get("kv_events", []))


def test_affinity_follows_a_prompt_cached_by_a_client_that_bypassed_the_gateway() -> None:
    ports = {"a": free_ports(2), "b": free_ports(2)}
    specs = [("vllm", n, {**FAST, "kv_events_config": events_flag(p)}) for n, p in ports.items()]
    with engines(*specs) as urls:
        backends = [
            {
                "name": n,
                "url": u,
                "kind": "vllm",
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{ports[n]}",
                    "replay_endpoint": f"tcp://127.0.0.1:{ports[n] + 1}",
                },
            }
            for n, u in urls.items()
        ]
        # chat_render: the simulated engine's template, so chat hashes match its events.
        cfg = gateway_cfg(backends, routing={"prefix": {"chat_render": {}}})
        with run_gateway(cfg) as gw:
            wait_until(
                lambda: all(
                    b["report"] and b["prefix_source"] == "events" for b in fleet(gw).values()
                ),
                what="both backends scraped and on events",
            )
            for i, (target, path) in enumerate(CASES):
                body: dict[str, Any] = {"model": "sim-model", "max_tokens": 1}
                if path == "/v1/completions":
                    body["prompt"] = document(i)
                else:
                    body["messages"] = [
                        {"role": "system", "content": document(i)},
                        {"role": "user", "content": f"question {i}?"},
                    ]
                before = blocks_on(gw, target)
                r = httpx.post(urls[target] + path, json=body, timeout=30)
                assert r.status_code == 200
                wait_until(
                    lambda t=target, n=before: blocks_on(gw, t) > n,  # type: ignore[misc]
                    what=f"{target}'s events",
                )
                r = httpx.post(gw + path, json=body, timeout=30)
                assert r.status_code == 200
                assert r.headers["x-kvroute-backend"] == target, (i, target, path)
            metrics = httpx.get(gw + "/metrics", timeout=5).text
            assert 'kvroute_kv_event_live{backend="a"} 1.0' in metrics
            assert 'kvroute_kv_events_total{backend="b",rank="0"}' in metrics


def test_a_prefix_cache_reset_without_a_restart_empties_the_engines_index() -> None:
    """vLLM's ``/reset_prefix_cache``: the process and its start time stay, the events say it.

    The render endpoint gives the engine's own token ids (what vllm-router ``kv_aware``
    matches with): their full blocks are exactly the blocks the engine's events stored.
    """
    ports = {"a": free_ports(2)}
    specs = [("vllm", n, {**FAST, "kv_events_config": events_flag(p)}) for n, p in ports.items()]
    with engines(*specs) as urls:
        backends = [
            {
                "name": "a",
                "url": urls["a"],
                "kind": "vllm",
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{ports['a']}",
                    "replay_endpoint": f"tcp://127.0.0.1:{ports['a'] + 1}",
                },
            }
        ]
        with run_gateway(gateway_cfg(backends)) as gw:
            wait_until(lambda: fleet(gw)["a"]["prefix_source"] == "events", what="events live")
            body = {"model": "sim-model", "prompt": document(7), "max_tokens": 1}
            rendered = httpx.post(urls["a"] + "/v1/completions/render", json=body, timeout=10)
            assert rendered.status_code == 200
            ids = rendered.json()[0]["token_ids"]
            assert len(ids) > 1_000 and all(isinstance(t, int) for t in ids)
            assert (
                httpx.post(urls["a"] + "/v1/completions", json=body, timeout=30).status_code == 200
            )
            wait_until(lambda: blocks_on(gw, "a") == len(ids) // 16, what="the stored blocks")
            started = fleet(gw)["a"]["report"]["started_at"]
            assert httpx.post(urls["a"] + "/reset_prefix_cache", timeout=10).status_code == 200
            wait_until(lambda: blocks_on(gw, "a") == 0, what="AllBlocksCleared applied")
            a = fleet(gw)["a"]
            assert a["prefix_source"] == "events"
            assert a["report"]["started_at"] == started
