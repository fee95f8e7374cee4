"""A request's prompt as token ids in the order a server would see them, for the prefix index.

The gateway does not render the model's chat template; it concatenates, per message, the
role and the text parts, in order. Two requests that share their first messages share the
leading ids here exactly as they share the leading tokens of their rendered templates,
which is what the prefix index compares (``proxy.core.prefix``). Media parts count as
their type only (their bytes are the model's processor's business).

Repeated messages (turn 20 of a chat resends turns 1-19; a shared document is resent with
every question) are tokenized once: ids are kept in a bounded LRU by a digest of the text.
Sizing counts through the same cache (``proxy.core.tokens``), so a request's texts are
encoded once for both its count and its prefix hashes.

Pure: no asyncio (``proxy.gateway.affinity`` runs big prompts in a worker thread).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from proxy.core.digest import text_digest
from proxy.core.prefix import block_hashes

#: A tokenizer's ids of a text; ideally already a 64-bit array (kept as is, no copy).
Encode = Callable[[str], Sequence[int]]


def _as_array(ids: Sequence[int]) -> array[int]:
    if isinstance(ids, array) and ids.typecode == "q":
        return ids
    return array("q", ids)


class IdsCache:
    """Bounded LRU of token ids by (tokenizer id, text digest); bounded by total ids held.

    Texts under ``min_chars`` (roles, the ``<role>`` markers, short messages) are kept apart,
    by their own value, in an LRU of ``max_small`` entries: sizing and the prefix hashes
    then encode them once, and repeated ones not at all. That matters on the event loop:
    every encode releases the GIL, and taking it back can wait for a worker thread that is
    hashing a big prompt.
    """

    def __init__(
        self, max_tokens: int = 2_000_000, min_chars: int = 256, max_small: int = 4096
    ) -> None:
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self.max_small = max_small
        self._lru: OrderedDict[bytes, array[int]] = OrderedDict()
        self._small: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def ids(self, encoder_id: str, encode: Encode, text: str) -> array[int]:
        if len(text) < self.min_chars:
            return self._small_ids(encoder_id, encode, text)
        if self.max_tokens <= 0:
            return _as_array(encode(text))
        # The text's digest is shared with the count cache's keys (one pass per sizing call).
        key = hashlib.blake2b(encoder_id.encode() + b"\0" + text_digest(text)).digest()
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit
        got = _as_array(encode(text))
        with self._lock:
            if key not in self._lru:
                self._lru[key] = got
                self._held += len(got)
            while self._held > self.max_tokens and self._lru:
                _, old = self._lru.popitem(last=False)
                self._held -= len(old)
        return got

    def _small_ids(self, encoder_id: str, encode: Encode, text: str) -> array[int]:
        if self.max_small <= 0:
            return _as_array(encode(text))
        key = (encoder_id, text)
        with self._lock:
            hit = self._small.get(key)
            if hit is not None:
                self._small.move_to_end(key)
                return hit
        got = _as_array(encode(text))
        with self._lock:
            self._small[key] = got
            while len(self._small) > self.max_small:
                self._small.popitem(last=False)
        return got


def prompt_ids(
    body: dict[str, Any],
    encoder_id: str,
    encode: Encode,
    max_tokens: int,
    cache: IdsCache | None = None,
) -> array[int]:
    """The leading ``max_tokens`` ids of the prompt (chat: messages in order; completions: first prompt)."""
    out: array[int] = array("q")

    def add(text: str) -> bool:
        if not text:
            return len(out) < max_tokens
        got = cache.ids(encoder_id, encode, text) if cache is not None else _as_array(encode(text))
        room = max_tokens - len(out)
        # Sliced only when cut: a slice copies (400 KB for a 50k-token text) before extend does.
        out.extend(got if len(got) <= room else got[:room])
        return len(out) < max_tokens

    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if not isinstance(m, dict):
                continue
            if not add(f"<{m.get('role', '')}>") or not _add_content(m.get("content"), add):
                break
        return out
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        out.extend(t for t in p[:max_tokens] if 0 <= t < 2**62)
    elif isinstance(p, list) and p:
        first = p[0]
        if isinstance(first, str):
            add(first)
        elif isinstance(first, list):
            out.extend(t for t in first[:max_tokens] if isinstance(t, int) and 0 <= t < 2**62)
    elif isinstance(p, str):
        add(p)
    return out


def _add_content(content: Any, add: Callable[[str], bool]) -> bool:
    if isinstance(content, str):
        return add(content)
    for part in content if isinstance(content, list) else []:
        if isinstance(part, str):
            text = part
        elif isinstance(part, dict):
            got = part.get("text")
            text = got if isinstance(got, str) else f"<{part.get('type')}>"
        else:
            continue
        if not add(str(text)):
            return False
    return True


def prompt_hashes(
    body: dict[str, Any],
    encoder_id: str,
    encode: Encode,
    max_tokens: int,
    block_tokens: int,
    cache: IdsCache | None = None,
) -> tuple[int, ...]:
    """The chained block hashes of the prompt's leading ``max_tokens`` ids (what the index keys)."""
    return tuple(
        block_hashes(prompt_ids(body, encoder_id, encode, max_tokens, cache), block_tokens)
    )
