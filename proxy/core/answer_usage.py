"""What a whole (non-streamed) OpenAI answer says about its output: tokens, why it ended, text.

Streams teach the output-length projection as they are relayed (``proxy.core.stream_progress``);
a JSON answer arrives whole, and its ``usage.completion_tokens`` is the server's own exact
count. Without reading it, every client that does not stream would be projected at
``max_tokens`` for ever (the learned ratios only ever saw streams). With ``n`` choices the
count covers all of them while ``max_tokens`` bounds each, so the count is per choice.

Pure: the parsed answer in, numbers out (the gateway parses each answer once, to check it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AnswerUsage:
    """One answer's output: tokens per choice, whether one ended at ``max_tokens``, characters."""

    completion_tokens: int
    at_length: bool
    chars: int


def _choice_chars(choice: object) -> int:
    """Bytes of text in one choice (chat ``message.content`` or completions ``text``).

    UTF-8 bytes, as a stream's characters are counted (``proxy.core.stream_progress``): the
    characters-per-token learned here is the one streams are read with.
    """
    if not isinstance(choice, dict):
        return 0
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return len(text.encode()) if isinstance(text, str) else 0


def answer_usage(data: Mapping[str, Any]) -> AnswerUsage | None:
    """The output of a JSON answer; None when it has no ``usage.completion_tokens`` to trust."""
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return None
    raw_choices = data.get("choices")
    choices = raw_choices if isinstance(raw_choices, list) and raw_choices else [None]
    at_length = any(isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices)
    per_choice = -(-tokens // len(choices))
    chars = sum(_choice_chars(c) for c in choices) // len(choices)
    return AnswerUsage(per_choice, at_length, chars)
