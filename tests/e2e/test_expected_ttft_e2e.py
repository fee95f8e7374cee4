"""Gateway + simulated vLLM engines (serial prefill, KV events): a hot document spills.

Eight questions about one cached document arrive at once, each with a long question of its
own. Pure affinity sends all eight to the engine holding the document, which prefills them
one after another; with ``routing.prefix.ttft_aware`` the gateway sends a question elsewhere
once the owner's queue of uncomputed prefill costs more than recomputing the document there
(``proxy.routing.expected_ttft``).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.support.behaviours import engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until
from tests.support.kv_events import free_ports

# 1,000 simulated tokens/s at speedup 2: 2,000 prompt tokens a second, one prompt at a time.
# Slow on purpose: each question's prefill (~1.8 s) must outlast the spread of the eight
# "simultaneous" arrivals on a loaded box (at 10,000 tokens/s, ~0.36 s each, arrivals spread
# wider than that once, so no queue built and all eight went to the owner).
SPEEDUP = 2
ENGINE = {
    "speedup": SPEEDUP,
    "block_size": 16,
    "capacity_tokens": 400_000,
    "prefill_tokens_per_s": 1_000,
    "serial_prefill": True,
}
QUESTIONS = 8


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["kv", "cache", "route", "engine", "token", "block", "prefix", "event", "gpu", "rank"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(words))


def events_flag(base: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{base}",
            "replay_endpoint": f"tcp://127.0.0.1:{base + 1}",
        }
    )


def fleet(gw: str) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw + "/fleet", timeout=5).json()["backends"]}


def blocks_on(gw: str, name: str) -> int:
    return sum(r["index_blocks"] for r in fleet(gw)[name].get("kv_events", []))


def ask(gw: str, prompt: str) -> str:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(gw + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-backend"]


def questions_land(ttft_aware: bool, seed: int) -> tuple[str, list[str]]:
    """(the document's owner, where each of the simultaneous questions went)."""
    ports = {"a": free_ports(2), "b": free_ports(2)}
    specs = [("vllm", n, {**ENGINE, "kv_events_config": events_flag(p)}) for n, p in ports.items()]
    with engines(*specs) as urls:
        backends = [
            {
                "name": n,
                "url": u,
                "kind": "vllm",
                "prefill_tokens_per_s": 1_000 * SPEEDUP,
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{ports[n]}",
                    "replay_endpoint": f"tcp://127.0.0.1:{ports[n] + 1}",
                },
            }
            for n, u in urls.items()
        ]
        routing = {"prefix": {"ttft_aware": ttft_aware}}
        with run_gateway(gateway_cfg(backends, routing=routing)) as gw:
            wait_until(
                lambda: all(
                    b["report"] and b["prefix_source"] == "events" for b in fleet(gw).values()
                ),
                what="both backends scraped and on events",
            )
            doc = text(seed, 3_000)
            owner = ask(gw, doc)
            wait_until(lambda: blocks_on(gw, owner) > 0, what="the owner's events")
            prompts = [doc + " " + text(seed * 100 + i, 1_200) for i in range(QUESTIONS)]
            with ThreadPoolExecutor(QUESTIONS) as pool:
                landed = list(pool.map(lambda p: ask(gw, p), prompts))
    return owner, landed


def test_a_hot_document_spills_to_a_second_engine_when_its_owners_queue_costs_more() -> None:
    owner, landed = questions_land(ttft_aware=True, seed=1)
    assert landed.count(owner) < QUESTIONS, landed
    # ... but stays mostly with its owner: only what its queue cannot serve sooner moves.
    assert landed.count(owner) >= QUESTIONS // 2, landed


def test_without_the_cost_rule_every_question_goes_to_the_owner() -> None:
    owner, landed = questions_land(ttft_aware=False, seed=2)
    assert landed == [owner] * QUESTIONS
