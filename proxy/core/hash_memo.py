"""Block hashes of prompts already hashed, found by their pieces, so a resent prefix is hashed once.

A long prompt's ~3,100 block hashes cost a few vectorized passes and the conversion of each
hash to a Python int (``proxy.core.chain_hash.pieces_hashes``): ~8% of the event loop's time
when 220 KB prompts are resent at 150 connections. Clients resend prompts: a chat's next
turn is its last prompt plus two messages, a retry or a replayed request is the same body.
The pieces cache (``proxy.core.prefix_prompt.PiecesCache``) already hands back the very same
``Piece`` objects for a text it holds, so a prompt's list of pieces identifies what it hashes
without reading a token: this memo keys the hashes by the identities of the pieces.

- **Exact**: an entry holds weak references to its pieces and is used only when each still
  names the very object in the prompt (an identity can be reused once its object is gone; an
  entry whose pieces died is dropped). It keeps no piece alive: the pieces cache's bound stays
  the bound on their memory.
- **Prefixes**: a prompt that is not held whole is looked up without its last pieces (up to
  ``lookback`` of them: a chat turn adds a few); from the longest held prefix only the new
  pieces are hashed, continuing the chain where the prefix stood
  (``pieces_hashes_from``).
- **Bounded** by the hashes held (an LRU of prompts); a prompt under ``min_hashes`` blocks
  is not kept (hashing it costs less than an entry).

Pure: no I/O. Thread-safe (sizing threads and the event loop share one memo).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.chain_hash import ChainAt, Piece, pieces_hashes_from

#: Lookups by result over every memo in the process (``kvroute_prefix_hash_memo_lookups``).
LOOKUPS = {"whole": 0, "prefix": 0, "miss": 0}

#: (block tokens, tokens hashed at most, the pieces' identities in order).
_Key = tuple[int, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _Entry:
    refs: tuple[weakref.ref[Piece], ...]  # the pieces whose identities key this entry
    hashes: tuple[int, ...]
    at: ChainAt


class HashMemo:
    """LRU of prompts' block hashes by their pieces' identities, bounded by hashes held."""

    def __init__(self, max_hashes: int = 250_000, lookback: int = 8, min_hashes: int = 64) -> None:
        self.max_hashes = max_hashes
        self.lookback = lookback
        self.min_hashes = min_hashes
        self._lru: OrderedDict[_Key, _Entry] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        #: Prompts found whole, found by a prefix, hashed from nothing (metrics, tests).
        self.whole = 0
        self.prefix = 0
        self.missed = 0

    @property
    def held_hashes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(
        self, pieces: Sequence[Piece], block_tokens: int, max_tokens: int
    ) -> tuple[int, ...]:
        """The block hashes of ``pieces`` (``pieces_hashes``), from the memo where it can."""
        ids = tuple(map(id, pieces))
        found = self._longest(block_tokens, max_tokens, ids, pieces)
        if found is not None and len(found[1]) == len(ids):
            return found[0].hashes
        if found is None:
            head: tuple[int, ...] = ()
            new, at = pieces_hashes_from(pieces, block_tokens, max_tokens)
        else:
            entry, done = found
            head = entry.hashes
            new, at = pieces_hashes_from(pieces[len(done) :], block_tokens, max_tokens, entry.at)
        out = head + tuple(new)
        if self.max_hashes > 0 and len(out) >= self.min_hashes:
            self._put(
                (block_tokens, max_tokens, ids), _Entry(tuple(map(weakref.ref, pieces)), out, at)
            )
        return out

    def _longest(
        self, block_tokens: int, max_tokens: int, ids: tuple[int, ...], pieces: Sequence[Piece]
    ) -> tuple[_Entry, tuple[int, ...]] | None:
        """The entry for the longest held prefix of ``ids`` (the whole first), and that prefix."""
        with self._lock:
            for k in range(len(ids), max(0, len(ids) - self.lookback - 1), -1):
                key = (block_tokens, max_tokens, ids[:k])
                entry = self._lru.get(key)
                if entry is None:
                    continue
                if not all(r() is p for r, p in zip(entry.refs, pieces, strict=False)):
                    # A piece it was keyed by is gone and its identity taken: not this prompt.
                    del self._lru[key]
                    self._held -= len(entry.hashes)
                    continue
                self._lru.move_to_end(key)
                if k == len(ids):
                    self.whole += 1
                    LOOKUPS["whole"] += 1
                else:
                    self.prefix += 1
                    LOOKUPS["prefix"] += 1
                return entry, key[2]
            self.missed += 1
            LOOKUPS["miss"] += 1
        return None

    def _put(self, key: _Key, entry: _Entry) -> None:
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._held -= len(old.hashes)
            self._lru[key] = entry
            self._held += len(entry.hashes)
            while self._held > self.max_hashes and self._lru:
                _, gone = self._lru.popitem(last=False)
                self._held -= len(gone.hashes)
