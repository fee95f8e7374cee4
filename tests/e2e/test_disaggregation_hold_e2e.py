"""Two-step requests held at the gateway until a decode server fits: their arrival order,
the prefill run during the hold (bounded per prefill server) and where the time went.

Real processes: simulated vLLM prefill and decode servers, ``kvroute serve``, and clients on
raw sockets where the test decides when a client leaves. One long request (``L1``) occupies
the only decode server for as long as its client stays: while it does, nothing that needs
that room can be placed, by design, so every "still waiting" below is a fact, not a race.
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.e2e.test_disaggregation_e2e import (
    SHORT_PROMPT,
    long_prompt,
    nothing_held,
    pd_backends,
)
from tests.support.behaviours import engines, server_state
from tests.support.gateway import all_reported, gateway_cfg, run_gateway, wait_until

# d1 holds one long request's whole KV (~400 prompt + 2,600 out) at a time, not two.
DECODE = {"pd_role": "decode", "capacity_tokens": 4096, "block_size": 16, "speedup": 1}
# L1 decodes for minutes unless its client leaves; the others stop after 4 tokens.
SLOW_DECODE = {**DECODE, "decode_tokens_per_s": 5}
BIG = 2_600


def metric(gw: str, line_start: str) -> float:
    """The value of the first metrics line starting with ``line_start`` (0 if none)."""
    for line in httpx.get(gw + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def two_step(gw: str, result: str) -> float:
    return metric(gw, f'kvroute_two_step_total{{result="{result}",step="prefill"}}')


@contextmanager
def raw_client(gw: str, prompt: str, stream: bool = False) -> Iterator[socket.socket]:
    """A completion request on a socket of its own; leaving the block closes it (the client
    leaves, unless it read its whole answer first)."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": BIG, "stream": stream}
    raw = orjson.dumps(body)
    parts = urlsplit(gw)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head + raw)
        yield sock


def send(gw: str, prompt: str, max_tokens: int) -> httpx.Response:
    """A completion whose client waits as long as the test runs (it may be held a while)."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(gw + "/v1/completions", json=body, timeout=300)


def timing(header: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"(\w+);dur=([0-9.]+)", header)}


def decode_running(url: str) -> int:
    return sum(e["running"] for e in server_state(url)["engines"])


def cfg(urls: dict[str, str], **memory_pressure: Any) -> Any:
    return gateway_cfg(
        pd_backends(urls),
        disaggregation={"min_uncached_prompt_tokens": 64, "early_prefill_fraction": 0.5},
        queue={"max_wait_s": 120},
        memory_pressure=memory_pressure,
    )


@contextmanager
def pd_pair(
    prefill: dict[str, Any], **memory_pressure: Any
) -> Iterator[tuple[dict[str, str], str]]:
    """Prefill server p1 (``prefill``: its flags), decode server d1 and the gateway, both
    servers reported: (their URLs, the gateway's)."""
    with engines(("vllm", "p1", prefill), ("vllm", "d1", SLOW_DECODE)) as urls:
        with run_gateway(cfg(urls, **memory_pressure)) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            yield urls, gw


@contextmanager
def l1_decoding(gw: str, urls: dict[str, str]) -> Iterator[None]:
    """L1 decodes on d1, holding its room, until the block ends (its client leaves)."""
    with raw_client(gw, long_prompt(1), stream=True):
        wait_until(lambda: decode_running(urls["d1"]) == 1, 30, "L1 decoding")
        yield


@pytest.mark.parametrize("max_overtakes", [0, 8])
def test_held_requests_keep_their_arrival_order_within_the_overtake_limit(
    max_overtakes: int,
) -> None:
    # p1 keeps what it computed for a held request (vLLM's 480 s) until d1 pulls it.
    prefill = {"pd_role": "prefill", "speedup": 20, "kv_hold_timeout_s": 480 * 20}
    with pd_pair(prefill, max_overtakes=max_overtakes) as (urls, gw):
        pool = concurrent.futures.ThreadPoolExecutor(2)
        with pool, l1_decoding(gw, urls):
            # L2 needs L1's room: it holds (its prompt computed meanwhile).
            held = pool.submit(send, gw, long_prompt(2) + "[eos:4]", BIG)
            wait_until(lambda: two_step(gw, "while_holding") == 1, 30, "L2 prefilled")
            wait_until(lambda: metric(gw, "kvroute_queue_depth ") == 1, 30, "L2 held")
            # A short one-step request that fits beside L1 now. It may overtake the held
            # request (8 times at most); with no overtakes allowed (L2 keeps d1's room)
            # it still goes first: it ends (8 tokens) long before L1 frees L2's room, so
            # it delays nothing (backfilling, proxy/core/aging.py).
            short = pool.submit(send, gw, SHORT_PROMPT, 8)
            assert short.result().status_code == 200
            assert not held.done()
        # L1's client left: its room goes to L2, then to the short one.
        assert held.result().status_code == 200, held.result().text
        assert short.result().status_code == 200
        answer = held.result()
        assert answer.headers["x-kvroute-prefill-backend"] == "p1"
        # Step 1 ran, and ended, during the hold; step 2 went once the hold was over.
        parts = timing(answer.headers["server-timing"])
        assert set(parts) == {"hold", "prefill", "decode_sent"}
        assert parts["prefill"] <= parts["hold"] <= parts["decode_sent"]
        wait_until(lambda: nothing_held(gw, urls), 30, "nothing held")


def test_prefills_during_a_hold_are_capped_per_prefill_server_and_released() -> None:
    # p1: 2,048 tokens, half of it for held requests' prompts: two of ~400 tokens, not three.
    # Its context (2,048) is shorter than a whole request (~3,000): step 1 needs only the prompt.
    prefill = {"pd_role": "prefill", "speedup": 20, "capacity_tokens": 2048}
    # Blocks nobody pulls (a client gone between the steps) expire after 15 s here.
    prefill["kv_hold_timeout_s"] = 300
    with pd_pair(prefill) as (urls, gw):
        held_gauge = 'kvroute_prefill_held_for_waiting_tokens{backend="p1"}'
        with l1_decoding(gw, urls):
            with raw_client(gw, long_prompt(2) + "[eos:4]"):
                with raw_client(gw, long_prompt(3) + "[eos:4]"):
                    wait_until(lambda: two_step(gw, "while_holding") == 2, 30, "2 prefilled")
                    both = metric(gw, held_gauge)
                    assert both > 0
                    with raw_client(gw, long_prompt(4) + "[eos:4]"):
                        # p1 holds its share: the fourth waits for a decode server first.
                        wait_until(lambda: two_step(gw, "after_holding") == 1, 30, "capped")
                        assert two_step(gw, "while_holding") == 2
                        assert metric(gw, held_gauge) == both
                # L3's client left (L4's too): its prompt is no longer counted against p1.
                wait_until(lambda: 0 < metric(gw, held_gauge) < both, 30, "L3 released")
            # L2's client left as well: nothing is counted for waiting requests any more.
            wait_until(lambda: metric(gw, held_gauge) == 0, 30, "all released")
            # Their holds ended with their clients, while d1 is still full.
            assert metric(gw, "kvroute_queue_depth ") == 0
            assert decode_running(urls["d1"]) == 1
        # ... and p1's own hold timeout frees the blocks that nobody pulled.
        wait_until(lambda: nothing_held(gw, urls), 60, "nothing held")


def test_a_request_held_while_every_prefill_server_was_full_prefills_once_one_has_room() -> None:
    # p1 holds two waiting prompts of ~400 tokens (half its 2,048), not three.
    prefill = {"pd_role": "prefill", "speedup": 20, "capacity_tokens": 2048}
    prefill["kv_hold_timeout_s"] = 300
    with pd_pair(prefill) as (urls, gw):
        pool = concurrent.futures.ThreadPoolExecutor(1)
        with pool, l1_decoding(gw, urls):
            with raw_client(gw, long_prompt(2) + "[eos:4]"):
                with raw_client(gw, long_prompt(3) + "[eos:4]"):
                    wait_until(lambda: two_step(gw, "while_holding") == 2, 30, "2 in")
                    late = pool.submit(send, gw, long_prompt(4) + "[eos:4]", BIG)
                    wait_until(lambda: two_step(gw, "after_holding") == 1, 30, "capped")
                    assert two_step(gw, "during_hold") == 0
                # L3's client left: p1 has room for one more waiting prompt, and L4
                # takes it during its hold (d1 is still L1's), not after it.
                wait_until(lambda: two_step(gw, "during_hold") == 1, 30, "L4 prefilled")
                assert decode_running(urls["d1"]) == 1
                # Still held, L2 and L4 both.
                assert metric(gw, "kvroute_queue_depth ") == 2
                assert not late.done()
        # L1's (and L2's) clients left: d1's room goes to L4, whose prompt is computed.
        answer = late.result()
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvroute-prefill-backend"] == "p1"
        assert two_step(gw, "while_holding") == 2
        assert two_step(gw, "after_holding") == 1
        parts = timing(answer.headers["server-timing"])
        assert parts["prefill"] <= parts["hold"] <= parts["decode_sent"]
        wait_until(lambda: nothing_held(gw, urls), 60, "nothing held")


def test_a_share_that_frees_goes_to_one_held_request_not_to_every_one_that_sees_it() -> None:
    # p1's share holds two prompts of ~400 tokens; each prefill takes ~2 s here, so a share
    # counted only once step 1 answers would look free to every held request meanwhile.
    prefill = {"pd_role": "prefill", "speedup": 1, "capacity_tokens": 2048}
    prefill |= {"prefill_tokens_per_s": 200, "kv_hold_timeout_s": 300}
    held_gauge = 'kvroute_prefill_held_for_waiting_tokens{backend="p1"}'
    with pd_pair(prefill) as (urls, gw):
        pool = concurrent.futures.ThreadPoolExecutor(2)
        with pool, l1_decoding(gw, urls):
            with raw_client(gw, long_prompt(2) + "[eos:4]"):
                with raw_client(gw, long_prompt(3) + "[eos:4]"):
                    # Step 1 of L1 (placed at once), L2 and L3 (during their holds) answered.
                    wait_until(lambda: two_step(gw, "ok") == 3, 60, "2 prefilled")
                    late = [pool.submit(send, gw, long_prompt(i) + "[eos:4]", BIG) for i in (4, 5)]
                    wait_until(lambda: two_step(gw, "after_holding") == 2, 30, "capped")
                # L3's client left: one share is free, and both L4 and L5 see it.
                wait_until(lambda: two_step(gw, "during_hold") == 1, 30, "one in")
                # Until that step 1 answers, the other must not take the same share.
                wait_until(lambda: two_step(gw, "ok") == 4, 60, "its step 1 done")
                assert two_step(gw, "during_hold") == 1
                assert metric(gw, held_gauge) <= 1024
                assert not any(f.done() for f in late)
        # L1's and L2's clients left: d1 serves the one prefilled, then the other.
        answers = [f.result() for f in late]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        wait_until(lambda: metric(gw, held_gauge) == 0, 30, "all released")
