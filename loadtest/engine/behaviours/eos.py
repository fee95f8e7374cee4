"""The simulated model's end of sequence: a prompt may say after how many tokens it ends.

A real model stops at its EOS token, usually long before ``max_tokens``; the simulated one
writes ``max_tokens`` unless the prompt carries the marker ``[eos:N]`` (benchmarks put it in
the last message): then it stops after ``N`` tokens (at most ``max_tokens``), with
``finish_reason: "stop"``. Inside the prompt, so that it reaches the engine through any
router unchanged.
"""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"\[eos:(\d+)\]")


def marker(n: int) -> str:
    """The text that makes the simulated model stop after ``n`` tokens."""
    return f"[eos:{n}]"


def _last_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        return content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def output_tokens(body: dict[str, Any], max_tokens: int) -> int:
    """Tokens the simulated model writes for this body: its marker's ``N``, or ``max_tokens``."""
    text = _last_text(body)
    # The marker sits at the end of the prompt; only the tail is searched (prompts are big).
    found = _MARKER.search(text[-64:])
    if found is None:
        return max_tokens
    return max(1, min(max_tokens, int(found.group(1))))
