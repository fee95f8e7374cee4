"""Big prompts through the real gateway: a document resent behind new questions is sized
exactly, from the chunk cache, on the event loop; only its new chunks are ever encoded.

The gateway runs on uvicorn in a thread, the engine is a simulated engine, the client is the
``openai`` package. Demand is read from the ``x-kvroute-demand-tokens`` header and compared
with tiktoken's own count; where each request was sized is read from ``/metrics``.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson

from loadtest.workload import make_prompt
from proxy.core.chunk_cuts import cut_points
from tests.core.test_sizing import MSG, PRIME, t
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in /metrics")


def _where(url: str, where: str) -> float:
    return _metric(url, f'kvroute_sizing_big_requests_total{{where="{where}"}}')


def _exact_cfg(backend: dict[str, Any]) -> Any:
    """Every request waits for its exact count: these tests are about the chunk cache's path
    (a new document may otherwise go on its bound first: tests/e2e/test_bound_route_e2e.py)."""
    return gateway_cfg([backend], sizing={"route_on_bound": False})


def test_a_document_behind_new_questions_is_sized_exactly_from_the_cache(
    engine_factory: Callable[..., Any],
) -> None:
    engine = engine_factory(name="e1")
    backend = {"name": engine.name, "url": engine.url, "kind": "contiguous"}
    with run_gateway(_exact_cfg(backend)) as url:
        wait_until(lambda: any(b["report"] for b in fleet_state(url)["backends"]), what="report")
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        # A document no other test sizes (the chunk cache is process-wide), fixed so that its
        # first cut is well inside the inline budget whatever question comes first.
        doc = make_prompt(12_000, random.Random(2029))
        first_cut = cut_points(doc.encode())[0]
        assert first_cut + 64 < gateway_cfg([backend]).routing.tokenize_in_thread_chars
        before = {w: _where(url, w) for w in ("cache", "encoded", "thread")}
        hits_before = _metric(url, "kvroute_sizing_chunk_cache_hits_total")
        for i in range(4):
            content = f"Question {i}: what does part {i} say?\n{doc}"
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model", messages=[{"role": "user", "content": content}], max_tokens=8
            )
            assert raw.http_response.status_code == 200
            want = PRIME + MSG + t("user") + t(content) + 8
            assert int(raw.headers["x-kvroute-demand-tokens"]) == want
        after = {w: _where(url, w) for w in ("cache", "encoded", "thread")}
        # The first was new (encoded in a sizing thread), the other three came from the cache.
        assert after["encoded"] - before["encoded"] == 1
        assert after["cache"] - before["cache"] == 3
        assert after["thread"] == before["thread"]
        assert _metric(url, "kvroute_sizing_chunk_cache_hits_total") > hits_before
        # The last body again: its pieces and its block hashes both come from memory.
        memo = 'kvroute_prefix_hash_memo_lookups_total{result="whole"}'
        whole_before = _metric(url, memo)
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": content}], max_tokens=8
        )
        assert int(raw.headers["x-kvroute-demand-tokens"]) == want
        assert _metric(url, memo) == whole_before + 1


def test_a_client_that_leaves_while_its_new_document_is_encoded_leaves_nothing_behind(
    engine_factory: Callable[..., Any],
) -> None:
    engine = engine_factory(name="e1")
    backend = {"name": engine.name, "url": engine.url, "kind": "contiguous"}
    with run_gateway(_exact_cfg(backend)) as url:
        wait_until(lambda: any(b["report"] for b in fleet_state(url)["backends"]), what="report")
        doc = make_prompt(15_000, random.Random(2930))
        raw = orjson.dumps(
            {"model": "sim-model", "messages": [{"role": "user", "content": doc}], "max_tokens": 8}
        )
        host, port = url.removeprefix("http://").split(":")
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
        ).encode()
        # The whole request, then gone before any answer: sizing (a new document, encoded in
        # a sizing thread) is under way when the connection closes.
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + raw)
        wait_until(
            lambda: _metric(url, "kvroute_reservations_held") == 0, what="no reservation held"
        )
        # The gateway goes on serving, exactly, the same document included.
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        content = "And now?\n" + doc
        answer = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": content}], max_tokens=8
        )
        want = PRIME + MSG + t("user") + t(content) + 8
        assert int(answer.headers["x-kvroute-demand-tokens"]) == want
        wait_until(
            lambda: _metric(url, "kvroute_reservations_held") == 0, what="no reservation held"
        )
