"""The simulated engines' mid-stream faults (loadtest/engine/behaviours/faults.py), black box.

An engine process in vLLM mode: ``POST /admin/fault`` validates its body (a 400 naming the
field), strikes exactly ``count`` streams after ``after_tokens`` tokens, and ``/admin/streams``
tells how each stream ended. (Through HTTP, not imports: ``tests/loadtest`` would shadow the
``loadtest`` package for an in-process import.)
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.behaviours import engines

FAST = {"speedup": 20, "model": "m"}


def stream(url: str, max_tokens: int = 8) -> list[str]:
    body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    lines: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.RemoteProtocolError:
        pass
    return lines


def test_a_fault_strikes_count_streams_after_n_tokens() -> None:
    with engines(("vllm", "e", FAST)) as urls:
        url = urls["e"]
        r = httpx.post(url + "/admin/fault", json={"mode": "die", "after_tokens": 3, "count": 2})
        assert r.json() == {"mode": "die", "after_tokens": 3, "count": 2}
        for _ in range(3):
            stream(url)
        ends = [
            (s["end"], len(s["text"].split())) for s in httpx.get(url + "/admin/streams").json()
        ]
        assert ends == [("died", 3), ("died", 3), ("done", 8)]
        assert httpx.get(url + "/admin/fault").json()["count"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"mode": "explode"}, "mode"),
        ({"mode": "die", "after_tokens": -1}, "after_tokens"),
        ({"mode": "die", "after_tokens": True}, "after_tokens"),
        ({"mode": "die", "count": 0}, "count"),
    ],
)
def test_a_bad_fault_request_is_a_400_naming_its_field(body: dict[str, Any], field: str) -> None:
    with engines(("vllm", "e", FAST)) as urls:
        r = httpx.post(urls["e"] + "/admin/fault", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"]
        assert httpx.get(urls["e"] + "/admin/fault").json()["mode"] == "none"
