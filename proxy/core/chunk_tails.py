"""A long text's chunks after its first cut, kept joined as one piece: the shared-document fast path.

Document Q&A sends the same document behind a different first line each time. The chunk
cache (``proxy.core.chunk_count``) finds every chunk after the first one in its LRU, but
only after cutting the whole text (a scan of every byte), keying each of ~50 chunks and
joining ~50 pieces into the prompt's hashes, every request. Everything after the first cut
depends on the bytes after it alone: the next cuts are chosen by content, each at least
``min_chunk_bytes`` after the one before, so from a given first cut they fall in the same
places whatever the head was. So the tail (the text from its first cut on) is keyed by its
own bytes, and on a hit the text is two pieces: the first chunk (looked up, or encoded when
new) and the tail joined (``proxy.core.chain_hash.joined``): one hash of the tail's bytes
and a scan of the first 32 KB instead of the whole cut.

The first cut of a text is found by cutting only its first ``FIRST_CUT_WITHIN`` bytes: a cut
found there is also the whole text's first cut (a candidate before it is refused in both for
being too near the start; it is at least ``min_chunk_bytes`` from either end of both).

A tail is joined only once it has come behind a second, different first chunk: a text that
recurs whole (the same body resent) gains nothing from it, and joining costs a pass over the
tail (~0.2 ms per 50k tokens); 64 different documents cycled through a memo too small for
them all would otherwise be joined and evicted on every request. Until then only the tail's
key and its first head's are kept (``MAX_SEEN`` of them).

Bounded: an LRU by bytes held, a quarter of the chunk cache's bound (the tails are derived
data: a lost tail costs one full cut, then is kept again). Thread-safe.

Pure: no I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from proxy.core.chain_hash import Piece, joined
from proxy.core.chunk_cuts import CutRule, cut_points

#: The first cut is looked for within this many bytes of the start.
FIRST_CUT_WITHIN = 32_768
#: What an entry costs beyond its piece (key, tuple, LRU links).
ENTRY_OVERHEAD_BYTES = 200
#: Tails seen once (their key and their first chunk's), waiting for a second head.
MAX_SEEN = 4096


@dataclass(frozen=True, slots=True)
class Tail:
    """Where a text's tail starts, its key, and what the memo holds for it (None: not yet)."""

    cut: int
    key: Hashable
    piece: Piece | None
    chunks: int


class TailMemo:
    """Tails by (tokenizer, tail bytes): one piece each, and how many chunks it joins."""

    def __init__(self, max_bytes: int, key: Callable[[str, bytes], Hashable]) -> None:
        self.max_bytes = max_bytes
        self._key = key
        self._lru: OrderedDict[Hashable, tuple[Piece, int]] = OrderedDict()
        self._seen: OrderedDict[Hashable, Hashable] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def held_bytes(self) -> int:
        return self._held

    def find(self, tokenizer: str, data: bytes, rule: CutRule) -> Tail | None:
        """``data``'s tail and the memo's piece for it; None when its first cut is not near the start."""
        if self.max_bytes <= 0:
            return None
        window = data[:FIRST_CUT_WITHIN]
        cuts = cut_points(window, rule)
        if not cuts:
            return None
        cut = cuts[0]
        key = self._key(tokenizer + "\0tail", data[cut:])
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
        if hit is None:
            return Tail(cut, key, None, 0)
        return Tail(cut, key, hit[0], hit[1])

    def offer(self, tail: Tail, head: Hashable, pieces: list[Piece]) -> None:
        """The tail came behind ``head`` (its first chunk's key) as ``pieces``: keep it joined
        if an earlier text had it behind another head, else remember that this one did."""
        if len(pieces) < 2 or self.max_bytes <= 0:
            return
        with self._lock:
            first = self._seen.get(tail.key)
            if first is None or first == head:
                self._seen[tail.key] = head
                self._seen.move_to_end(tail.key)
                while len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return
            del self._seen[tail.key]
        self._keep(tail, pieces)

    def _keep(self, tail: Tail, pieces: list[Piece]) -> None:
        piece = joined(pieces)
        cost = piece.nbytes + ENTRY_OVERHEAD_BYTES
        if cost > self.max_bytes:
            return
        piece.flags.writeable = False
        with self._lock:
            if tail.key in self._lru:
                return
            self._lru[tail.key] = (piece, len(pieces))
            self._held += cost
            self._trim()

    def bound(self, max_bytes: int) -> None:
        """A new bound (a reload of ``sizing.chunk_cache_mb``); drops the oldest above it."""
        with self._lock:
            self.max_bytes = max_bytes
            self._trim()

    def _trim(self) -> None:
        while self._held > self.max_bytes and self._lru:
            _, (old, _chunks) = self._lru.popitem(last=False)
            self._held -= old.nbytes + ENTRY_OVERHEAD_BYTES
