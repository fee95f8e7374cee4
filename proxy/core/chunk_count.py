"""Exact token counts and ids of long texts from cached chunks, wherever in a prompt they recur.

Clients resend the same long text: a chat its whole history each turn, document Q&A the same
document after a short varying header. A cache keyed by the whole text misses as soon as the
header changes; this one cuts a text into chunks of a few KB at *content-defined* safe
boundaries and keys each chunk by its own bytes, so after a different head the cuts fall on
the same places again and every later chunk is a hit. A text's ids are the concatenation of
its chunks' ids, its count their sum: only new chunks are encoded.

Why exact: chunks are cut only right before a space that sits between two ASCII letters.
In the pre-tokenizers admitted here (cl100k's, and Hugging Face byte-level BPEs with the
GPT-2, Llama-3 or Qwen2 split pattern), such a space always starts a new piece and no piece
spans it, and BPE never merges across pieces, so encoding the two sides apart gives the
same ids (``proxy.core.tokenizer.safe_cut`` has the argument in full). Property tests
compare against a full encode (tests/test_chunk_count.py).

Why content-defined: of those candidate spaces, a cut is made where a mix of the 8 bytes
before the space falls in 1/``CUT_ONE_IN`` of its range (and at least ``MIN_CHUNK_BYTES``
after the last cut). Whether a position is a cut depends only on the text around it, not on
where the text started, so a document cuts the same behind any header. Finding them is a few
numpy passes over the UTF-8 bytes (~0.3 ms per 220 KB), never a Python loop per character.

Keys: Python's ``hash`` of the chunk's bytes (SipHash-1-3 under a per-process random key),
its length and the tokenizer id. Measured on the shared 2-core box (220 KB in 4 KB chunks,
best of 5, /tmp/hashbench in the issue-29 notes): ``hash(bytes)`` 160 us (1.4 GB/s),
``hashlib.sha1`` 355 us, ``blake2b`` (16-byte digest) 1149 us, ``md5`` 1052 us; xxhash is
not installed. The random key means no client can craft a colliding chunk; with hash
randomization off (``PYTHONHASHSEED=0``) keys fall back to 16-byte BLAKE2b digests.

Bounded: an LRU by bytes held (ids at 4 bytes a token plus a fixed overhead per entry).
Hits and misses are counted for ``kvroute_sizing_chunk_cache_*`` (proxy.gateway.sizing_metrics).

Pure: no I/O, no asyncio. Thread-safe: sizing threads and the event loop share one cache.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from proxy.core.tokenizer import Counter

Ids = npt.NDArray[np.uint32]
#: A tokenizer's ids of one chunk (the caller's encoder, ids as a uint32 buffer).
EncodeChunk = Callable[[str], Ids]

#: Texts shorter than this are encoded whole (a chunk lookup would cost more than it saves).
CHUNK_ABOVE_CHARS = 8192
#: One candidate space in this many becomes a cut (English: ~1 space in 6 bytes -> ~4 KB chunks).
CUT_ONE_IN = 1024
#: No cut closer than this to the previous one (repetitive text would cut at every space).
MIN_CHUNK_BYTES = 1024
#: What an entry costs beyond its ids: key tuple, array header, LRU links (measured ~180 B).
ENTRY_OVERHEAD_BYTES = 200

_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_M1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_S31 = np.uint64(31)
_WINDOW = 8
_SPACE, _CASE, _A, _LETTERS = np.uint8(0x20), np.uint8(0x20), np.uint8(ord("a")), np.uint8(26)


@dataclass(frozen=True, slots=True)
class CutRule:
    """How sparse the cuts are: a 1-in-2**``pre_bits`` byte test, then 1-in-2**``mix_bits``.

    The default makes ~4-7 KB chunks of prose. Tests use ``DENSE`` (every candidate space is
    a cut, chunks of any size) so that a property test exercises thousands of cuts.
    """

    pre_bits: int = 6
    mix_bits: int = 4
    min_chunk_bytes: int = MIN_CHUNK_BYTES


DEFAULT_RULE = CutRule()
DENSE = CutRule(0, 0, 1)


def cut_points(data: bytes, rule: CutRule = DEFAULT_RULE) -> list[int]:
    """Byte offsets where ``data`` (UTF-8) is cut into chunks, chosen by content alone.

    A cut sits right before a space between two ASCII letters (exact to encode apart) whose
    preceding 8 bytes mix to a value in the top 1/``CUT_ONE_IN`` of the range, at least
    ``MIN_CHUNK_BYTES`` after the previous cut. ASCII bytes never occur inside a multi-byte
    UTF-8 sequence, so every cut is also a character boundary.
    """
    n = len(data)
    least = rule.min_chunk_bytes
    if n < max(2 * least, _WINDOW + 2):
        return []
    b = np.frombuffer(data, dtype=np.uint8)
    w = _WINDOW
    # Whole-array uint8 passes (SIMD, ~15 us each per 220 KB) thin the candidates before any
    # gather: a space between two ASCII letters whose 3 preceding bytes pass a 1-in-64 test.
    mask = b[w:-1] == _SPACE
    mask &= ((b[w - 1 : -2] | _CASE) - _A) < _LETTERS
    mask &= ((b[w + 1 :] | _CASE) - _A) < _LETTERS
    pre = b[w - 1 : -2] * np.uint8(167)
    pre += b[w - 2 : -3] * np.uint8(53)
    pre += b[w - 3 : -4] * np.uint8(97)
    mask &= (pre & np.uint8((1 << rule.pre_bits) - 1)) == 0
    idx = np.flatnonzero(mask) + w
    if idx.size == 0:
        return []
    # The 8 bytes before each survivor as one little-endian word: a strided, unaligned view.
    words = np.ndarray((n - w + 1,), dtype="<u8", buffer=data, strides=(1,))
    mixed = words[idx - w]
    mixed *= _GOLDEN
    mixed ^= mixed >> _S31
    mixed *= _M1
    top = mixed >> np.uint64(64 - rule.mix_bits) if rule.mix_bits else np.zeros_like(mixed)
    chosen: list[int] = idx[top == 0].tolist()
    cuts: list[int] = []
    last = 0
    for c in chosen:
        if c - last >= least and n - c >= least:
            cuts.append(c)
            last = c
    return cuts


def _chunk_key_fast(tokenizer: str, chunk: bytes) -> Hashable:
    return (tokenizer, hash(chunk), len(chunk))


def _chunk_key_digest(tokenizer: str, chunk: bytes) -> Hashable:
    return (tokenizer, hashlib.blake2b(chunk, digest_size=16).digest())


#: With a fixed hash seed anyone could craft colliding chunks: use a digest then.
chunk_key: Callable[[str, bytes], Hashable] = (
    _chunk_key_fast if sys.flags.hash_randomization else _chunk_key_digest
)


class ChunkCache:
    """LRU of chunk ids by (tokenizer, chunk), bounded by bytes held; shared across threads."""

    def __init__(self, max_bytes: int = 64 << 20, rule: CutRule = DEFAULT_RULE) -> None:
        self.max_bytes = max_bytes
        self.rule = rule
        self._lru: OrderedDict[Hashable, Ids] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        #: Chunks found / encoded, and the bytes of each (hit rate by work saved).
        self.hits = 0
        self.misses = 0
        self.hit_bytes = 0
        self.miss_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._lru)

    def ids(self, tokenizer: str, encode: EncodeChunk, text: str) -> Ids:
        """``encode(text)``, exact, with every chunk seen before taken from the cache."""
        parts = self.parts(tokenizer, encode, text)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def count(self, tokenizer: str, encode: EncodeChunk, text: str) -> int:
        return sum(p.size for p in self.parts(tokenizer, encode, text))

    def parts(self, tokenizer: str, encode: EncodeChunk, text: str) -> list[Ids]:
        """The ids of ``text``'s chunks in order (one part when it is not cut)."""
        data = text.encode("utf-8", "surrogatepass")
        cuts = cut_points(data, self.rule) if len(text) >= CHUNK_ABOVE_CHARS else []
        if not cuts:
            return [encode(text)]
        bounds = [0, *cuts, len(data)]
        ascii_text = text.isascii()
        parts: list[Ids] = []
        for a, b in itertools.pairwise(bounds):
            chunk = data[a:b]
            key = chunk_key(tokenizer, chunk)
            got = self._get(key, len(chunk))
            if got is None:
                piece = text[a:b] if ascii_text else chunk.decode("utf-8", "surrogatepass")
                got = encode(piece)
                self._put(key, got, len(chunk))
            parts.append(got)
        return parts

    def _get(self, key: Hashable, size: int) -> Ids | None:
        with self._lock:
            got = self._lru.get(key)
            if got is None:
                self.misses += 1
                self.miss_bytes += size
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            self.hit_bytes += size
            return got

    def _put(self, key: Hashable, ids: Ids, size: int) -> None:
        cost = ids.nbytes + ENTRY_OVERHEAD_BYTES
        if cost > self.max_bytes:
            return
        # Read-only: the same array is handed to every later request that meets the chunk.
        ids.flags.writeable = False
        with self._lock:
            if key in self._lru:
                return
            self._lru[key] = ids
            self._held += cost
            while self._held > self.max_bytes and self._lru:
                _, old = self._lru.popitem(last=False)
                self._held -= old.nbytes + ENTRY_OVERHEAD_BYTES


def as_int64_array(ids: Ids) -> array[int]:
    """uint32 ids as the 64-bit ``array`` the prefix index hashes (one copy, no Python ints)."""
    out: array[int] = array("q")
    out.frombytes(ids.astype(np.int64).data.cast("B"))
    return out


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


class ChunkedCounter:
    """A counter whose long texts go through the chunk cache (same id, same counts, same ids).

    Wraps a tokenizer whose ``chunk_encoder()`` is not None (``chunked`` checks). Short
    texts go straight to it. ``ids`` serves the prefix index (``proxy.core.prefix_prompt``),
    so a request's count and its block hashes come from the same chunk lookups.
    """

    def __init__(self, inner: _ChunkableCounter, encode: EncodeChunk, cache: ChunkCache) -> None:
        self.inner = inner
        self._encode = encode
        self._cache = cache
        self._id = inner.id

    @property
    def id(self) -> str:
        return self._id

    def count(self, text: str) -> int:
        if len(text) < CHUNK_ABOVE_CHARS or self._cache.max_bytes <= 0:
            return self.inner.count(text)
        return self._cache.count(self._id, self._encode, text)

    def ids(self, text: str) -> array[int]:
        if len(text) < CHUNK_ABOVE_CHARS or self._cache.max_bytes <= 0:
            return self.inner.ids(text)
        return as_int64_array(self._cache.ids(self._id, self._encode, text))


@runtime_checkable
class _ChunkableCounter(Protocol):
    @property
    def id(self) -> str: ...

    def count(self, text: str) -> int: ...

    def ids(self, text: str) -> array[int]: ...

    def chunk_encoder(self) -> EncodeChunk | None: ...


def chunked(counter: Counter, cache: ChunkCache | None = None) -> Counter:
    """``counter`` behind the chunk cache when its tokenizer can be cut exactly, else itself."""
    if not isinstance(counter, _ChunkableCounter):
        return counter
    encode = counter.chunk_encoder()
    if encode is None:
        return counter
    return ChunkedCounter(counter, encode, cache if cache is not None else _shared)
