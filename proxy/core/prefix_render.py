"""A chat prompt's tokens as the *server* renders it, for hashes that match its events.

``proxy.core.prefix_prompt`` renders chats the gateway's own way; an engine's KV-cache
events (``proxy.core.exact_prefix``) carry the ids of the engine's rendering, so the exact
index can only match requests hashed the engine's way (``routing.prefix.chat_render``,
``proxy.config.kv_events.ChatRender``). Each rendered text goes through the pieces cache,
so a document resent with every question is tokenized once.

Pure: no asyncio.
"""

from __future__ import annotations

from typing import Any

from proxy.config.kv_events import ChatRender
from proxy.core.chain_hash import Piece, joined, pieces_hashes
from proxy.core.prefix_prompt import PiecesCache, TextPieces


def rendered_pieces(
    messages: list[Any],
    render: ChatRender,
    encoder_id: str,
    encode: TextPieces,
    max_tokens: int,
    cache: PiecesCache,
) -> list[Piece]:
    """The pieces of ``begin``, each rendered message, ``generation``: ``max_tokens`` at least."""
    out: list[Piece] = []
    held = 0
    texts = [render.begin]
    for m in messages:
        if isinstance(m, dict):
            texts.append(render.message.format(role=m.get("role", ""), content=_text(m)))
    texts.append(render.generation)
    for text in texts:
        if held >= max_tokens:
            break
        if text:
            got, size = cache.tokens(encoder_id, encode, text)
            out.extend(got)
            held += size
    return out


def rendered_values(
    messages: list[Any],
    render: ChatRender,
    encoder_id: str,
    encode: TextPieces,
    cache: PiecesCache,
) -> Piece:
    """The whole rendering as one piece (tests compare it with the engine's own ids)."""
    return joined(rendered_pieces(messages, render, encoder_id, encode, 1 << 62, cache))


def rendered_hashes(
    messages: list[Any],
    render: ChatRender,
    encoder_id: str,
    encode: TextPieces,
    max_tokens: int,
    block_tokens: int,
    cache: PiecesCache,
) -> tuple[int, ...]:
    pieces = rendered_pieces(messages, render, encoder_id, encode, max_tokens, cache)
    return tuple(pieces_hashes(pieces, block_tokens, max_tokens))


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""
