"""A held request overtaken its limit keeps one node's room, not the whole fleet's.

Real processes: two simulated vLLM engines (paged, lazy growth) of different sizes,
``kvroute serve`` in front, clients on raw sockets where the test decides how long a
request stays. The rule is ``proxy.core.aging`` with ``proxy.gateway.held_room``.
"""

from __future__ import annotations

import concurrent.futures
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from loadtest.engine.behaviours.eos import marker
from tests.support.behaviours import engine_state, engines
from tests.support.gateway import all_reported, gateway_cfg, run_gateway, wait_until

ENGINE = {"block_size": 16, "speedup": 1, "model": "m"}


@contextmanager
def staying(gw: str, max_tokens: int, words: int = 40) -> Iterator[socket.socket]:
    """A streamed completion of a ``words``-token prompt whose client stays until the block
    ends (then leaves)."""
    body = {"model": "m", "prompt": "word " * words, "max_tokens": max_tokens, "stream": True}
    raw = orjson.dumps(body)
    parts = urlsplit(gw)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {parts.hostname}\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80)) as sock:
        sock.sendall(head + raw)
        yield sock


def send(gw: str, max_tokens: int, words: int = 40) -> httpx.Response:
    """A completion that asks for ``max_tokens`` (the gateway counts them) and stops at 4."""
    body = {"model": "m", "prompt": "word " * words + marker(4), "max_tokens": max_tokens}
    return httpx.post(gw + "/v1/completions", json=body, timeout=120)


def running(url: str) -> int:
    return sum(e["running"] for e in engine_state(url))


def cfg(urls: dict[str, str]) -> Any:
    backends = [{"name": n, "url": u, "kind": "vllm"} for n, u in urls.items()]
    return gateway_cfg(
        backends,
        queue={"max_wait_s": 120},
        memory_pressure={"max_hold_s": 300, "max_overtakes": 0},
    )


def queue_depth(gw: str) -> float:
    for line in httpx.get(gw + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvroute_queue_depth "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_starving_request_no_longer_stops_placements_on_the_whole_fleet() -> None:
    # a: 2,048 tokens; b: 1,024. A long stream fills most of a (~1,550 at its peak), a
    # medium one most of b (~650). A document of ~1,050 fits neither; with no overtakes
    # allowed it starves at once and keeps one node. Before, a starving request stopped
    # every newer placement: the chat, which fits on either node, waited for the document,
    # which waits for the long stream (50 s of decoding).
    specs = [
        ("vllm", "a", {"capacity_tokens": 2048, **ENGINE}),
        ("vllm", "b", {"capacity_tokens": 1024, **ENGINE}),
    ]
    with engines(*specs) as urls:
        with run_gateway(cfg(urls)) as gw, concurrent.futures.ThreadPoolExecutor(2) as pool:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            with staying(gw, 1500), staying(gw, 600):
                wait_until(lambda: running(urls["a"]) == running(urls["b"]) == 1, 30, "both busy")
                document = pool.submit(send, gw, 1000)
                wait_until(lambda: queue_depth(gw) == 1, 30, "the document held")
                chat = send(gw, 100)
                assert chat.status_code == 200, chat.text
                assert not document.done()
            # The streams' clients left: their room goes to the document.
            answer = document.result()
            assert answer.status_code == 200, answer.text
            # Where its time went: the hold, in milliseconds.
            held_ms = float(answer.headers["server-timing"].removeprefix("hold;dur="))
            assert held_ms > 0
