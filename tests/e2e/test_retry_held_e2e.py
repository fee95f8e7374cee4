"""A retry that no backend takes at once is held as a first attempt is, not answered 502.

"A backend failure never loses a request another backend could serve": a request whose
attempt failed on one backend while the others were busy used to get that failure as its
answer at once, though a busy backend frees within seconds. It now waits in the admission
queue (``queue.max_wait_s``) for room, as a first attempt waits. Where no other backend can
serve it at all (down, unreachable), the failure is still the answer at once: a hold could
only delay it. Real simulated engines, a real gateway, real clients; margins of 5x or more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from loadtest.local_fleet import free_port
from loadtest.workload import make_prompt
from tests.support.gateway import all_reported, gateway_cfg, run_gateway, wait_until


def backend(engine: Any) -> dict[str, Any]:
    return {"name": engine.name, "url": engine.url, "kind": "contiguous"}


def chat(url: str, prompt_tokens: int) -> httpx.Response:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": make_prompt(prompt_tokens)}],
        "max_tokens": 16,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_a_retry_that_nothing_takes_now_waits_for_a_busy_backend_not_a_502(
    engine_factory: Callable[..., Any],
) -> None:
    failing = engine_factory(name="failing")
    busy = engine_factory(name="busy")
    cap = int(busy.state()["capacity_tokens"])
    # 1,000 tokens left free: the 5,000-token request fits only on "failing".
    held = busy.hold(cap - 1_000)
    failing.fault("error500")
    cfg = gateway_cfg([backend(failing), backend(busy)], queue={"max_wait_s": 20.0})
    with run_gateway(cfg) as url:
        wait_until(lambda: all_reported(url, 2), 10, "both engines scraped")
        answer: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answer.append(chat(url, 5_000)))
        sender.start()
        # The attempt on "failing" fails at once; the retry finds no room and is held.
        time.sleep(1.0)
        still_waiting = sender.is_alive()
        released_at = time.monotonic()
        busy.release(held)
        sender.join(30)
        answered_at = time.monotonic()
    assert still_waiting, f"answered before the busy backend freed: {answer[0].status_code}"
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    assert answer[0].headers["x-kvroute-backend"] == "busy"
    assert answered_at >= released_at


def test_a_retry_with_no_other_backend_up_gets_the_failure_at_once(
    engine_factory: Callable[..., Any],
) -> None:
    failing = engine_factory(name="failing")
    failing.fault("error500")
    gone = {"name": "gone", "url": f"http://127.0.0.1:{free_port()}", "kind": "contiguous"}
    cfg = gateway_cfg([backend(failing), gone], queue={"max_wait_s": 20.0})
    with run_gateway(cfg) as url:
        wait_until(lambda: all_reported(url, 1), 10, "the live engine scraped")
        started = time.monotonic()
        r = chat(url, 200)
        took = time.monotonic() - started
    # The other backend cannot serve it however long the request waits: no hold.
    assert r.status_code == 502, r.text
    assert took < 10.0, f"held {took:.1f}s for a backend that is down"
