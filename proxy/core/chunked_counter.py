"""A tokenizer behind the chunk cache, and the process's one chunk cache.

``chunked`` wraps a counter whose tokenizer can be cut exactly (``chunk_encoder()`` is not
None) so that its long texts go through ``proxy.core.chunk_count``; any other counter is
returned as it is (still exact, only not chunk-cached). ``Sizer.from_config`` wraps each
configured tokenizer; every config and reload shares the one cache (keys name the tokenizer).

Pure: no I/O.
"""

from __future__ import annotations

from array import array
from typing import Protocol, runtime_checkable

from proxy.core.chain_hash import Piece, piece_of
from proxy.core.chunk_count import (
    CHUNK_ABOVE_CHARS,
    ENTRY_OVERHEAD_BYTES,
    ChunkCache,
    EncodeChunk,
    TokenBytes,
    spend,
)
from proxy.core.tokenizer import Counter

_shared = ChunkCache()


def shared_cache() -> ChunkCache:
    """The process's chunk cache: every config (and reload) shares it; keys name the tokenizer."""
    return _shared


def configure(max_bytes: int) -> None:
    """Bound the shared cache at ``max_bytes`` (``sizing.chunk_cache_mb``); 0 turns it off."""
    _shared.max_bytes = max_bytes
    with _shared._lock:
        while _shared._held > max_bytes and _shared._lru:
            _, old = _shared._lru.popitem(last=False)
            _shared._held -= old.nbytes + ENTRY_OVERHEAD_BYTES
    _shared.tails.bound(max_bytes // 4)


class ChunkedCounter:
    """A counter whose long texts go through the chunk cache (same id, same counts, same ids).

    Wraps a tokenizer whose ``chunk_encoder()`` is not None (``chunked`` checks). Short
    texts go straight to it. ``pieces`` serves both the count and the prefix index
    (``proxy.core.prefix_prompt``), so a request's count and its block hashes come from the
    same chunk lookups.
    """

    def __init__(self, inner: _ChunkableCounter, encode: EncodeChunk, cache: ChunkCache) -> None:
        self.inner = inner
        self._encode = encode
        self._cache = cache
        self._id = inner.id

    @property
    def id(self) -> str:
        return self._id

    @property
    def cache(self) -> ChunkCache:
        return self._cache

    def count(self, text: str) -> int:
        if len(text) < CHUNK_ABOVE_CHARS or self._cache.max_bytes <= 0:
            spend(len(text))
            return self.inner.count(text)
        return self._cache.count(self._id, self._encode, text)

    def ids(self, text: str) -> array[int]:
        """The tokenizer's own ids (a full encode: the gateway's paths use ``pieces``)."""
        spend(len(text))
        return self.inner.ids(text)

    def pieces(self, text: str) -> list[Piece]:
        """``text``'s pieces (``proxy.core.chain_hash``), new chunks only encoded."""
        if len(text) < CHUNK_ABOVE_CHARS or self._cache.max_bytes <= 0:
            spend(len(text))
            return [piece_of(self.inner.ids(text))]
        return self._cache.pieces(self._id, self._encode, text)


@runtime_checkable
class _ChunkableCounter(Protocol):
    @property
    def id(self) -> str: ...

    def count(self, text: str) -> int: ...

    def ids(self, text: str) -> array[int]: ...

    def chunk_encoder(self) -> EncodeChunk | None: ...

    def token_bytes(self) -> TokenBytes | None: ...


def chunked(counter: Counter, cache: ChunkCache | None = None) -> Counter:
    """``counter`` behind the chunk cache when its tokenizer can be cut exactly, else itself."""
    if not isinstance(counter, _ChunkableCounter):
        return counter
    encode = counter.chunk_encoder()
    if encode is None:
        return counter
    cache = cache if cache is not None else _shared
    if cache.lengths(counter.id) is None:
        table = counter.token_bytes()
        if table is not None:
            cache.teach(counter.id, table)
    return ChunkedCounter(counter, encode, cache)
