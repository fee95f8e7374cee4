"""The pure parts of stream continuation: the transcript, the continuation request, the splice."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.config import ConfigError, parse_config
from proxy.core.continuation import Splice, continuation_body, not_continuable
from proxy.core.stream_transcript import Transcript, split_events


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(content: str | None = None, finish: str | None = None, **delta: Any) -> bytes:
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return sse({"id": "c-1", "created": 7, "model": "m", "choices": [choice]})


def text_chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return sse({"id": "x-1", "created": 9, "model": "m", "choices": [choice]})


def test_only_whole_events_pass_and_a_partial_one_is_held_back() -> None:
    t = Transcript("completions")
    whole, half = text_chunk("Hello"), text_chunk(" world")
    assert t.feed(whole + half[:10]) == whole
    assert t.text == "Hello"
    assert t.feed(half[10:]) == half
    assert t.text == "Hello world" and t.text_events == 2
    assert t.identity == {"id": "x-1", "created": 9, "model": "m"}
    assert split_events(b"data: a\r\n\r\ndata: b") == ([b"data: a\r\n\r\n"], b"data: b")


def test_an_error_event_and_all_after_it_are_withheld() -> None:
    t = Transcript("chat")
    error = sse({"error": {"message": "engine dead", "type": "x", "param": None, "code": 500}})
    out = t.feed(chat_chunk("Hi") + error + b"data: [DONE]\n\n")
    assert out == chat_chunk("Hi") and t.error == "engine dead"
    assert t.feed(b"more") == b""
    assert t.final_error_event().endswith(b"data: [DONE]\n\nmore")
    t.next_part()
    assert t.error is None and t.feed(chat_chunk("!")) == chat_chunk("!") and t.text == "Hi!"


@pytest.mark.parametrize(
    ("delta", "blocker"),
    [
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}, "tool_call"),
        ({"reasoning_content": "hmm"}, "reasoning"),
    ],
)
def test_what_the_stream_shows_can_block_a_continuation(delta: Any, blocker: str) -> None:
    t = Transcript("chat")
    t.feed(chat_chunk(**delta))
    assert t.blocker == blocker


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"n": 2}, "several_choices"),
        ({"best_of": 3}, "several_choices"),
        ({"logprobs": 2}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"guided_json": {}}, "structured_output"),
        ({"prompt": [1, 2, 3]}, "prompt_not_text"),
        ({"prompt": ["a", "b"]}, "prompt_not_text"),
        ({"n": 1, "logprobs": None, "response_format": {"type": "text"}}, None),
    ],
)
def test_requests_never_continued(body: dict[str, Any], reason: str | None) -> None:
    assert not_continuable({"prompt": "p", **body}, "completions") == reason


def test_completions_carry_the_text_and_the_rest_of_the_budget() -> None:
    body = {"model": "m", "prompt": "Once", "max_tokens": 10, "min_tokens": 4, "stream": True}
    out = continuation_body(body, "completions", " upon a", 2)
    assert out == {**body, "prompt": "Once upon a", "max_tokens": 8, "min_tokens": 2}
    assert body["prompt"] == "Once"  # the client's body is not changed
    # Without max_tokens, OpenAI's default of 16 is the whole budget.
    assert continuation_body({"prompt": ["Once"]}, "completions", " upon", 1) == {
        "prompt": ["Once upon"],
        "max_tokens": 15,
    }
    assert continuation_body(body, "completions", "x" * 10, 10) is None


def test_chat_carries_the_partial_assistant_message() -> None:
    messages = [{"role": "user", "content": "Tell me"}]
    body = {"messages": messages, "max_completion_tokens": 20, "max_tokens": 99}
    out = continuation_body(body, "chat", "It was", 2)
    assert out is not None
    assert out["messages"] == [*messages, {"role": "assistant", "content": "It was"}]
    assert out["max_completion_tokens"] == 18 and out["max_tokens"] == 99
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    # The client's own prefill is extended, not followed by a second assistant message.
    prefill = {
        "messages": [*messages, {"role": "assistant", "content": "Sure:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    out = continuation_body(prefill, "chat", " one", 1)
    assert out is not None and out["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert "max_tokens" not in out  # chat's default (the rest of the context) stays


def test_the_splice_makes_the_continuation_the_same_stream() -> None:
    splice = Splice("chat", {"id": "c-1", "created": 7, "model": "m"}, 5, ["a", "b"], ["reset"])
    other = {"id": "c-2", "created": 8, "model": "m2"}

    def part2(**delta: Any) -> bytes:
        fin = delta.pop("finish", None)
        choice = {"index": 0, "delta": delta, "finish_reason": fin}
        return sse({**other, "choices": [choice]})

    assert splice.rewrite(part2(role="assistant", content="")) is None
    kept = splice.rewrite(part2(role="assistant", content="x"))
    assert kept is not None
    obj = json.loads(kept[6:])
    assert (
        obj["id"] == "c-1"
        and obj["created"] == 7
        and obj["choices"][0]["delta"] == {"content": "x"}
    )
    final = splice.rewrite(part2(content="", finish="stop"))
    assert final is not None
    assert json.loads(final[6:])["metadata"] == {
        "kvroute_continuations": "1",
        "kvroute_backends": "a,b",
        "kvroute_causes": "reset",
    }
    usage = {"prompt_tokens": 25, "completion_tokens": 10, "total_tokens": 35}
    rewritten = splice.rewrite(sse({**other, "choices": [], "usage": usage}))
    assert rewritten is not None
    assert json.loads(rewritten[6:])["usage"] == {
        "prompt_tokens": 20,
        "completion_tokens": 15,
        "total_tokens": 35,
    }
    assert splice.rewrite(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_the_continuation_section_names_a_bad_key_and_value() -> None:
    base: dict[str, Any] = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    cfg = parse_config(base, "test", environ={})
    assert cfg.continuation.covers("vllm", "m") and not cfg.continuation.covers("tgi", "m")
    with pytest.raises(ConfigError, match=r"continuation\.max_continuations"):
        parse_config({**base, "continuation": {"max_continuations": -1}}, "test", environ={})
    with pytest.raises(ConfigError, match=r"continuation\.kinds"):
        parse_config({**base, "continuation": {"kinds": ["vllm", "nginx"]}}, "test", environ={})
