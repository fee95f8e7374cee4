"""Streams continued on another backend when theirs dies mid-answer (proxy/gateway/continuation.py).

Real engine processes (vLLM mode) with mid-stream faults (loadtest/engine/behaviours/faults.py),
the real gateway, the real ``openai`` client or httpx. Each engine's journal (``/admin/streams``)
says what it was asked and what it sent, so the client's text is checked against the parts.
Round-robin routing makes the first stream land on ``a`` (names in order), so the fault there
strikes it; the continuation cannot go back to ``a``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support.behaviours import engines
from tests.support.counting_store import CountingStore
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

FAST = {"speedup": 20, "block_size": 16, "model": "m"}
PROMPT = "Summarise the quarterly report in plain words."


def fault(url: str, mode: str, after: int, count: int | None = 1) -> None:
    body = {"mode": mode, "after_tokens": after, "count": count}
    assert httpx.post(url + "/admin/fault", json=body, timeout=5).status_code == 200


def journal(url: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = httpx.get(url + "/admin/streams", timeout=5).json()
    return records


def metric(gw: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` of the gateway's /metrics (0 when absent)."""
    text = httpx.get(gw + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def counted(gw: str, name: str, value: float, **labels: str) -> None:
    """Wait for ``name{labels}`` to read ``value`` (/metrics answers may be a moment old)."""
    wait_until(lambda: metric(gw, name, **labels) == value, what=f"{name}{labels} == {value}")


@contextmanager
def fleet(
    names: str = "ab", continuation: dict[str, Any] | None = None, **engine: Any
) -> Iterator[tuple[str, dict[str, str], CountingStore]]:
    specs = [("vllm", n, {**FAST, **engine}) for n in names]
    with engines(*specs) as urls:
        backends = [{"name": n, "url": u, "kind": "vllm"} for n, u in urls.items()]
        cfg = gateway_cfg(
            backends,
            routing={"policy": "round_robin"},
            continuation=continuation or {},
            log={"access_log": True},
        )
        store = CountingStore()
        with run_gateway(cfg, store=store) as gw:
            wait_until(
                lambda: all(b["report"] for b in fleet_state(gw)["backends"]), what="reports"
            )
            yield gw, urls, store


def released_once(gw: str, store: CountingStore) -> None:
    """Nothing held, nothing pending, and each reservation released exactly once."""

    def settled() -> bool:
        res = fleet_state(gw)["reservations"]
        return res == {"held": 0, "pending_releases": 0} and store.balanced()

    wait_until(settled, what="every reservation released once")


def stream_completion(gw: str, **extra: Any) -> tuple[str, list[Any]]:
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
    chunks = list(
        client.completions.create(
            model="m",
            prompt=PROMPT,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_completion_continued_after_its_backend_dies() -> None:
    with fleet() as (gw, urls, store):
        fault(urls["a"], "die", after=6)
        text, chunks = stream_completion(gw)
        (died,) = journal(urls["a"])
        (resumed,) = journal(urls["b"])
        assert died["end"] == "died" and resumed["end"] == "done"
        # The continuation carried exactly what the client had, and asked for the rest.
        assert resumed["body"]["prompt"] == PROMPT + died["text"]
        assert resumed["body"]["max_tokens"] == 30 - 6
        assert text == died["text"] + resumed["text"]
        # One stream: one id, one finish, usage over both parts, the marker on the final chunk.
        assert len({c.id for c in chunks}) == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 30
        final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        meta = (final.model_extra or {})["metadata"]
        assert meta == {
            "kvroute_continuations": "1",
            "kvroute_backends": "a,b",
            "kvroute_causes": "reset",
        }
        counted(gw, "kvroute_continuations_total", 1, outcome="completed")
        counted(gw, "kvroute_stream_breaks_total", 1, cause="reset", action="continued")
        released_once(gw, store)


def test_chat_continued_with_the_partial_assistant_message(caplog: Any) -> None:
    caplog.set_level("INFO", logger="kvroute.access")
    with fleet() as (gw, urls, store):
        fault(urls["a"], "die", after=5)
        client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=20,
                stream=True,  # type: ignore[arg-type]
            )
        )
        (died,) = journal(urls["a"])
        (resumed,) = journal(urls["b"])
        body = resumed["body"]
        assert body["messages"] == [*messages, {"role": "assistant", "content": died["text"]}]
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == 15
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == died["text"] + resumed["text"]
        # One role opener, one id and model, in the client's one stream.
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
        assert len({(c.id, c.created, c.model) for c in chunks}) == 1
        released_once(gw, store)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.access"]
    assert any("backend=a" in ln and "continued_on=b" in ln for ln in lines), lines


def test_a_stall_past_the_stall_timeout_is_continued() -> None:
    with fleet(continuation={"stall_timeout_s": 0.5}) as (gw, urls, store):
        fault(urls["a"], "stall", after=4)
        text, _ = stream_completion(gw)
        (stalled,) = journal(urls["a"])
        (resumed,) = journal(urls["b"])
        assert stalled["end"] == "stalled"
        assert text == stalled["text"] + resumed["text"]
        counted(gw, "kvroute_stream_breaks_total", 1, cause="stall", action="continued")
        released_once(gw, store)


def test_an_error_event_mid_stream_is_continued_not_relayed() -> None:
    with fleet() as (gw, urls, store):
        fault(urls["a"], "error", after=3)
        with httpx.stream(
            "POST",
            gw + "/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "stream": True},
            timeout=30,
        ) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert not any('"error"' in e for e in events)
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        (errored,) = journal(urls["a"])
        (resumed,) = journal(urls["b"])
        assert text == errored["text"] + resumed["text"]
        released_once(gw, store)


def test_a_second_failure_is_continued_again_within_the_limit() -> None:
    # a dies, the continuation lands on c (round robin over b, c) and dies too, b finishes.
    with fleet("abc", continuation={"max_continuations": 2}) as (gw, urls, store):
        fault(urls["a"], "die", after=4)
        fault(urls["c"], "die", after=5)
        text, chunks = stream_completion(gw)
        (first,) = journal(urls["a"])
        (second,) = journal(urls["c"])
        (third,) = journal(urls["b"])
        assert second["body"]["prompt"] == PROMPT + first["text"]
        assert third["body"]["prompt"] == PROMPT + first["text"] + second["text"]
        assert third["body"]["max_tokens"] == 30 - 4 - 5
        assert text == first["text"] + second["text"] + third["text"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30
        final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        assert (final.model_extra or {})["metadata"]["kvroute_backends"] == "a,c,b"
        counted(gw, "kvroute_continuations_total", 1, outcome="broke_again")
        released_once(gw, store)


def test_a_second_failure_past_the_limit_ends_with_todays_error_event() -> None:
    with fleet() as (gw, urls, store):
        fault(urls["a"], "die", after=4)
        fault(urls["b"], "die", after=3)
        with httpx.stream(
            "POST",
            gw + "/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": 30, "stream": True},
            timeout=30,
        ) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == "upstream_stream_broken"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        assert text == journal(urls["a"])[0]["text"] + journal(urls["b"])[0]["text"]
        counted(gw, "kvroute_stream_breaks_total", 1, cause="reset", action="limit_reached")
        released_once(gw, store)


def test_the_client_leaving_during_the_continuation_frees_everything() -> None:
    # Slow engines: the continuation is still generating when the client goes.
    slow = {"decode_tokens_per_s": 10, "speedup": 1}
    with fleet(**slow) as (gw, urls, store):
        fault(urls["a"], "die", after=3)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": True}
        seen = 0
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 6:
                    break
        # b saw the cancel: it was working on the continuation when the client left.
        wait_until(
            lambda: [r["end"] for r in journal(urls["b"])] == ["cancelled"],
            what="the continuation cancelled at b",
        )
        assert journal(urls["b"])[0]["body"]["prompt"].startswith(
            PROMPT + journal(urls["a"])[0]["text"]
        )
        wait_until(
            lambda: metric(gw, "kvroute_continuations_total", outcome="client_left") == 1,
            what="counted as client_left",
        )
        released_once(gw, store)


def test_logprobs_are_not_continued() -> None:
    with fleet() as (gw, urls, store):
        fault(urls["a"], "die", after=4)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 30, "stream": True, "logprobs": 1}
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "upstream_stream_broken"
        assert journal(urls["b"]) == []
        counted(gw, "kvroute_stream_breaks_total", 1, cause="reset", action="not_continuable")
        released_once(gw, store)


def test_continuation_off_keeps_todays_error_event() -> None:
    with fleet(continuation={"enabled": False}) as (gw, urls, store):
        fault(urls["a"], "die", after=4)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 30, "stream": True}
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "upstream_stream_broken"
        assert journal(urls["b"]) == []
        released_once(gw, store)
