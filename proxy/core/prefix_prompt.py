"""A request's prompt as token pieces in the order a server would see them, for the prefix index.

The gateway does not render the model's chat template; it concatenates, per message, the
role and the text parts, in order. Two requests that share their first messages share the
leading tokens here exactly as they share the leading tokens of their rendered templates,
which is what the prefix index compares (``proxy.core.prefix``). Media parts count as
their type only (their bytes are the model's processor's business).

Each text is a list of ``Piece``s (``proxy.core.chain_hash``): the running values its block
hashes are made of, position-independent, so a text's pieces are reused wherever it sits in
a prompt. Repeated messages (turn 20 of a chat resends turns 1-19; a shared document is
resent with every question) are tokenized once: pieces are kept in a bounded LRU by a digest
of the text. Sizing counts through the same cache (``proxy.core.tokens``), so a request's
texts are encoded once for both its count and its prefix hashes. A prompt whose pieces all
come from that cache (the same body again, a chat's next turn) also finds its block hashes,
or those of its longest known prefix, in the cache's hash memo (``proxy.core.hash_memo``).

Pure: no asyncio (``proxy.gateway.affinity`` runs big prompts in a worker thread).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from proxy.core.chain_hash import Piece, piece_of, pieces_hashes
from proxy.core.digest import text_digest
from proxy.core.hash_memo import HashMemo

#: A tokenizer's pieces of a text (``ChunkedCounter.pieces``, or its ids as one piece).
TextPieces = Callable[[str], list[Piece]]


def text_pieces(counter: object) -> TextPieces | None:
    """How ``counter`` gives a text's pieces; None when it gives no token ids at all."""
    pieces: TextPieces | None = getattr(counter, "pieces", None)
    if pieces is not None:
        return pieces
    ids = getattr(counter, "ids", None)
    if ids is None:
        return None

    def one_piece(text: str) -> list[Piece]:
        return [piece_of(ids(text))]

    return one_piece


#: A text's pieces and how many tokens they stand for (kept together: one sum per text).
Tokens = tuple[list[Piece], int]


def _tokens(encode: TextPieces, text: str) -> Tokens:
    got = encode(text)
    return got, sum(p.size for p in got)


class PiecesCache:
    """Bounded LRU of a text's pieces by (tokenizer id, text digest); bounded by tokens held.

    The bound counts each distinct piece once: texts that share a piece (a document's joined
    tail behind 64 different first lines, ``proxy.core.chunk_tails``) share its memory, and
    counting it per text made 64 such 50k-token texts look like 3.2M tokens, over the bound,
    so that cycling through them evicted each one just before it came back. Entries are
    bounded in number too (``max_entries``): texts made only of pieces held already (the
    same chunks in another order) add entries but no tokens.

    Texts under ``min_chars`` (roles, the ``<role>`` markers, short messages) are kept apart,
    by their own value, in an LRU of ``max_small`` entries: sizing and the prefix hashes
    then encode them once, and repeated ones not at all. That matters on the event loop:
    every encode releases the GIL, and taking it back can wait for a worker thread that is
    hashing a big prompt. Pieces are shared with the chunk cache (no copies).
    """

    def __init__(
        self,
        max_tokens: int = 2_000_000,
        min_chars: int = 256,
        max_small: int = 4096,
        max_entries: int = 16_384,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.min_chars = min_chars
        self.max_small = max_small
        self._lru: OrderedDict[bytes, Tokens] = OrderedDict()
        self._small: OrderedDict[tuple[str, str], Tokens] = OrderedDict()
        # id(piece) -> [entries holding it, its tokens]: each distinct piece counted once.
        self._pieces: dict[int, list[int]] = {}
        self._held = 0
        self._lock = threading.Lock()
        #: Block hashes of prompts made of this cache's pieces (``prompt_hashes``).
        self.hashes = HashMemo()

    @property
    def held_tokens(self) -> int:
        """Tokens of the distinct pieces the long texts' entries hold."""
        return self._held

    def tokens(self, encoder_id: str, encode: TextPieces, text: str) -> Tokens:
        """``text``'s pieces and their token count, encoded only when not held."""
        if len(text) < self.min_chars:
            return self._small_tokens(encoder_id, encode, text)
        if self.max_tokens <= 0:
            return _tokens(encode, text)
        # The text's digest is shared with the count cache's keys (one pass per sizing call).
        key = hashlib.blake2b(encoder_id.encode() + b"\0" + text_digest(text)).digest()
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit
        got = _tokens(encode, text)
        with self._lock:
            if key not in self._lru:
                self._lru[key] = got
                self._hold(got[0])
            while (self._held > self.max_tokens or len(self._lru) > self.max_entries) and self._lru:
                _, old = self._lru.popitem(last=False)
                self._release(old[0])
        return got

    def _hold(self, pieces: list[Piece]) -> None:
        for p in {id(p): p for p in pieces}.values():
            seen = self._pieces.get(id(p))
            if seen is None:
                self._pieces[id(p)] = [1, p.size]
                self._held += p.size
            else:
                seen[0] += 1

    def _release(self, pieces: list[Piece]) -> None:
        # The entry still holds its pieces here, so no identity below has been reused.
        for key in {id(p) for p in pieces}:
            seen = self._pieces[key]
            seen[0] -= 1
            if seen[0] == 0:
                del self._pieces[key]
                self._held -= seen[1]

    def count(self, encoder_id: str, encode: TextPieces, text: str) -> int:
        return self.tokens(encoder_id, encode, text)[1]

    def _small_tokens(self, encoder_id: str, encode: TextPieces, text: str) -> Tokens:
        if self.max_small <= 0:
            return _tokens(encode, text)
        key = (encoder_id, text)
        with self._lock:
            hit = self._small.get(key)
            if hit is not None:
                self._small.move_to_end(key)
                return hit
        got = _tokens(encode, text)
        with self._lock:
            self._small[key] = got
            while len(self._small) > self.max_small:
                self._small.popitem(last=False)
        return got


def prompt_pieces(
    body: dict[str, Any],
    encoder_id: str,
    encode: TextPieces,
    max_tokens: int,
    cache: PiecesCache | None = None,
) -> Tokens:
    """The prompt's pieces (chat: messages in order; completions: first prompt) and their
    tokens, at least ``max_tokens`` of them where the prompt has that many (hashes cut there)."""
    out: list[Piece] = []
    held = 0

    def add(text: str) -> bool:
        nonlocal held
        if text:
            got = (
                cache.tokens(encoder_id, encode, text)
                if cache is not None
                else _tokens(encode, text)
            )
            out.extend(got[0])
            held += got[1]
        return held < max_tokens

    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if not isinstance(m, dict):
                continue
            if not add(f"<{m.get('role', '')}>") or not _add_content(m.get("content"), add):
                break
        return out, held
    p = body.get("prompt")
    ids: list[int] | None = None
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        ids = [t for t in p[:max_tokens] if 0 <= t < 2**62]
    elif isinstance(p, list) and p:
        first = p[0]
        if isinstance(first, str):
            add(first)
        elif isinstance(first, list):
            ids = [t for t in first[:max_tokens] if isinstance(t, int) and 0 <= t < 2**62]
    elif isinstance(p, str):
        add(p)
    if ids:
        out.append(piece_of(ids))
        held += len(ids)
    return out, held


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
    encode: TextPieces,
    max_tokens: int,
    block_tokens: int,
    cache: PiecesCache | None = None,
) -> tuple[int, ...]:
    """The chained block hashes of the prompt's leading ``max_tokens`` tokens (what the index keys)."""
    pieces, held = prompt_pieces(body, encoder_id, encode, max_tokens, cache)
    if held < block_tokens:
        return ()  # under one block ("Say hi."): nothing to hash, no numpy at all
    if cache is not None:
        return cache.hashes.hashes(pieces, block_tokens, max_tokens)
    return tuple(pieces_hashes(pieces, block_tokens, max_tokens))
