"""One gateway in front of vLLM (data parallel 2), SGLang, TGI and a contiguous kvroute engine.

Each serves chat, completions and streams through the gateway (each backend its own model,
so model routing picks it), and while a stream is in flight on it, the gateway's view of its
memory (``/fleet``, read by that kind's adapter) equals the engine's own ground truth.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.support.behaviours import engine_state, engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until

# A paged engine's memory grows by one 16-token block every 4 s of decode: the gateway's scrape
# and the engine's own count can meet on the same value however loaded the machine (at 50
# tokens/s the plateau was 0.3 s, and under load the two reads missed each other).
FLAGS = {"decode_tokens_per_s": 4, "speedup": 1, "capacity_tokens": 8192, "block_size": 16}
# Long enough to outlast the four checks (they stop the streams when done).
IN_FLIGHT_TOKENS = 2_000
KINDS = {"v": "vllm", "s": "sglang", "t": "tgi", "k": "contiguous"}


def fleet(gw: str) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in httpx.get(gw + "/fleet", timeout=5).json()["backends"]}


def truth(name: str, url: str) -> tuple[int, tuple[int, ...]]:
    """(free tokens, per-engine free) as the engine itself counts them."""
    if KINDS[name] == "contiguous":
        st = httpx.get(url + "/admin/state", timeout=5).json()
        return int(st["free_tokens"]), ()
    per = tuple(int(e["free_tokens"]) for e in engine_state(url))
    return sum(per), per if len(per) > 1 else ()


def read_right(gw: str, name: str, url: str) -> bool:
    report = fleet(gw)[name]["report"]
    free, per = truth(name, url)
    if report is None or report["free_tokens"] != free or free >= report["capacity_tokens"]:
        return False
    return not per or tuple(report["engine_free_tokens"]) == per


def stream(gw: str, model: str, max_tokens: int) -> tuple[str, list[str]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story " * 20}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        return r.headers["x-kvroute-backend"], lines


def stream_until(gw: str, model: str, stop: threading.Event) -> str:
    """A stream kept in flight until ``stop`` is set; the backend that served it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story " * 20}],
        "max_tokens": IN_FLIGHT_TOKENS,
        "stream": True,
    }
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for _ in r.iter_lines():
            if stop.is_set():
                break
        return r.headers["x-kvroute-backend"]


# Five engine processes, twelve answers and four checks: the default bound is too tight on a
# loaded 2-core machine, not a measure of anything.
@pytest.mark.timeout(360)
def test_mixed_fleet_serves_everything_and_reads_each_memory_right() -> None:
    specs = [
        ("vllm", "v", {"model": "mv", "data_parallel": 2, **FLAGS}),
        ("sglang", "s", {"model": "ms", **FLAGS}),
        ("tgi", "t", {"model": "mt", **FLAGS}),
        ("kvroute", "k", {"model": "mk", **FLAGS}),
    ]
    with engines(*specs) as urls:
        backends = [
            {"name": n, "url": u, "kind": KINDS[n], "models": ["m" + n]} for n, u in urls.items()
        ]
        cfg = gateway_cfg(backends, routing={"unknown_model": "reject"})
        with run_gateway(cfg) as gw:
            wait_until(lambda: all(b["report"] for b in fleet(gw).values()), 60, what="reports")
            for name in urls:
                model = "m" + name
                chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                r = httpx.post(
                    gw + "/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=30
                )
                assert r.status_code == 200 and r.headers["x-kvroute-backend"] == name
                assert r.json()["choices"][0]["message"]["content"]
                comp = {"model": model, "prompt": "once upon a time", "max_tokens": 2}
                r = httpx.post(gw + "/v1/completions", json=comp, timeout=30)
                assert r.status_code == 200 and r.headers["x-kvroute-backend"] == name
                assert r.json()["choices"][0]["text"]
                backend, lines = stream(gw, model, 2)
                assert backend == name and lines[-1] == "data: [DONE]"
                chunks = [orjson.loads(ln[5:]) for ln in lines[:-1]]
                assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
            # Memory with a stream in flight on every backend: as each engine counts it.
            stop = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(stream_until, gw, "m" + n, stop) for n in urls]
                try:
                    for name, url in urls.items():
                        wait_until(
                            lambda n=name, u=url: read_right(gw, n, u),  # type: ignore[misc]
                            60,
                            what=f"{name}'s memory read as the engine counts it",
                        )
                finally:
                    stop.set()
                assert sorted(f.result() for f in futs) == sorted(urls)
