"""A chat prompt's token ids as the *server* renders it, for hashes that match its events.

``proxy.core.prefix_prompt`` renders chats the gateway's own way; an engine's KV-cache
events (``proxy.core.exact_prefix``) carry the ids of the engine's rendering, so the exact
index can only match requests hashed the engine's way (``routing.prefix.chat_render``,
``proxy.config.kv_events.ChatRender``). Each rendered piece goes through the ids cache, so
a document resent with every question is tokenized once.

Pure: no asyncio.
"""

from __future__ import annotations

from array import array
from typing import Any

from proxy.config.kv_events import ChatRender
from proxy.core.prefix import block_hashes
from proxy.core.prefix_prompt import Encode, IdsCache


def rendered_ids(
    messages: list[Any],
    render: ChatRender,
    encoder_id: str,
    encode: Encode,
    max_tokens: int,
    cache: IdsCache,
) -> array[int]:
    """The leading ``max_tokens`` ids of ``begin``, each rendered message, ``generation``."""
    out: array[int] = array("q")
    pieces = [render.begin]
    for m in messages:
        if isinstance(m, dict):
            pieces.append(render.message.format(role=m.get("role", ""), content=_text(m)))
    pieces.append(render.generation)
    for piece in pieces:
        if len(out) >= max_tokens:
            break
        if piece:
            out.extend(cache.ids(encoder_id, encode, piece)[: max_tokens - len(out)])
    return out


def rendered_hashes(
    messages: list[Any],
    render: ChatRender,
    encoder_id: str,
    encode: Encode,
    max_tokens: int,
    block_tokens: int,
    cache: IdsCache,
) -> tuple[int, ...]:
    ids = rendered_ids(messages, render, encoder_id, encode, max_tokens, cache)
    return tuple(block_hashes(ids, block_tokens))


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""
