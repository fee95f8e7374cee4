"""Request validation: every bad input is a 4xx in OpenAI's error format, good input passes."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.validation import parse_request
from proxy.errors import ApiError
from proxy.upstream.classify import classify_response


def _parse(body: object, endpoint: str = "chat", ct: str | None = "application/json") -> object:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(raw, endpoint, 100_000, ct)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "endpoint", "status", "param"),
    [
        (b"{not json", "chat", 400, None),
        (b"", "chat", 400, None),
        (b"[1,2]", "chat", 400, None),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat", 400, "model"),
        ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "chat", 400, "model"),
        ({"model": "m"}, "chat", 400, "messages"),
        ({"model": "m", "messages": []}, "chat", 400, "messages"),
        ({"model": "m", "messages": "hi"}, "chat", 400, "messages"),
        (
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "chat",
            400,
            "messages[0].role",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "chat",
            400,
            "messages[0].content",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            "chat",
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12},
            "chat",
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"},
            "chat",
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "chat",
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            "chat",
            400,
            "stream",
        ),
        ({"model": "m"}, "completions", 400, "prompt"),
        ({"model": "m", "prompt": {"a": 1}}, "completions", 400, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "completions", 400, "prompt"),
    ],
)
def test_bad_input_is_a_clear_4xx(
    body: object, endpoint: str, status: int, param: str | None
) -> None:
    with pytest.raises(ApiError) as exc:
        _parse(body, endpoint)
    assert exc.value.status == status
    assert exc.value.param == param
    err = exc.value.body()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]


def test_wrong_content_type_is_415() -> None:
    with pytest.raises(ApiError) as exc:
        _parse({"model": "m", "prompt": "x"}, "completions", ct="text/plain")
    assert exc.value.status == 415


def test_good_requests_parse() -> None:
    p = _parse(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7,
            "stream": True,
        }
    )
    assert p.stream and p.max_new_tokens == 7  # type: ignore[attr-defined]
    q = _parse({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "n": 2}, "completions")
    assert q.max_new_tokens == 10  # type: ignore[attr-defined]  # n sequences each hold KV
    assert (q.max_tokens, q.sequences) == (5, 2)  # type: ignore[attr-defined]


def test_classify_upstream_answers() -> None:
    alloc = orjson.dumps(
        {
            "error": {
                "type": "kv_cache_allocation_error",
                "message": "no block",
                "free_tokens": 38000,
                "largest_free_block_tokens": 1200,
            }
        }
    )
    v = classify_response(503, alloc)
    assert (
        v.verdict == "allocation" and v.free_tokens == 38000 and v.largest_free_block_tokens == 1200
    )
    assert classify_response(500, b"CUDA out of memory while allocating").verdict == "allocation"
    assert classify_response(503, b"busy", "3").verdict == "overload"
    assert classify_response(503, b"busy", "3").retry_after_s == 3.0
    assert classify_response(502, b"bad gateway").verdict == "server_error"
    assert classify_response(400, b'{"error": {"message": "bad"}}').verdict == "client_error"
    assert classify_response(200, b"").verdict == "ok"


_MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("body", "endpoint", "param"),
    [
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": 5}]},
            "chat",
            "messages[0].name",
        ),
        (
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": "f()"}]},
            "chat",
            "messages[0].tool_calls",
        ),
        ({"model": "m", "messages": _MSG, "tools": {"type": "function"}}, "chat", "tools"),
        ({"model": "m", "messages": _MSG, "max_tokens": 0}, "chat", "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "completions", "max_tokens"),
        ({"model": "m", "prompt": "x", "best_of": 0}, "completions", "best_of"),
        ({"model": "m", "prompt_embeds": 5}, "completions", "prompt_embeds"),
        ({"model": "m", "prompt_embeds": []}, "completions", "prompt_embeds"),
    ],
)
def test_bad_new_shapes_are_400(body: object, endpoint: str, param: str) -> None:
    with pytest.raises(ApiError) as exc:
        _parse(body, endpoint)
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize(
    ("body", "endpoint"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": ["bare", "strings"]}]}, "chat"),
        ({"model": "m", "messages": [{"role": "developer", "content": "x"}]}, "chat"),
        ({"model": "m", "messages": [{"role": "ipython", "content": "x"}]}, "chat"),
        (
            {"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
            "chat",
        ),
        ({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}, "completions"),
        ({"model": "m", "prompt_embeds": "AAAA"}, "completions"),
    ],
)
def test_shapes_servers_accept_parse(body: object, endpoint: str) -> None:
    _parse(body, endpoint)
