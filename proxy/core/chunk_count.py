"""Exact token counts and ids of long texts from cached chunks, wherever in a prompt they recur.

Clients resend the same long text: a chat its whole history each turn, document Q&A the same
document after a short varying header. A cache keyed by the whole text misses as soon as the
header changes; this one cuts a text into chunks of a few KB at content-defined safe
boundaries (``proxy.core.chunk_cuts``) and keys each chunk by its own bytes, so behind a
different head every later chunk is a hit. Each chunk is kept as its ``Piece``
(``proxy.core.chain_hash``: the running values its prefix hashes are made of, which do not
depend on where the chunk sits), so a text's count is its chunks' sizes summed and its block
hashes come from the same lookups: only new chunks are encoded. Property tests compare
against a full encode (tests/core/test_chunk_count.py).

New chunks next to each other are encoded in one call and the ids split at the chunk
boundaries by each token's byte length (a table per tokenizer; the split is checked to land
exactly on every boundary, else each chunk is encoded alone). One call matters: each encode
releases the GIL, and taking it back in a sizing thread while the event loop is busy waits
up to the 5 ms switch interval; a 220 KB text encoded as 50 chunks waited that 50 times.

``inline_budget``: the gateway first sizes a big request on the event loop with a budget of
bytes it may encode there; when the cache already holds nearly all of it the request never
waits for a sizing thread (``proxy.gateway.sizing``), else ``TooMuchToEncode`` sends it there.

Keys: Python's ``hash`` of the chunk's bytes (SipHash-1-3 under a per-process random key),
its length and the tokenizer id. Measured, CPU time per 220 KB in 4 KB chunks on the shared
2-core box (best of 5): ``hash(bytes)`` 160 us, ``hashlib.sha1`` 355 us, ``md5`` 1052 us,
``blake2b`` (16-byte digest) 1149 us; xxhash is not installed. The random key means no
client can craft a colliding chunk; with hash randomization off (``PYTHONHASHSEED=0``) keys
are 16-byte BLAKE2b digests instead.

Bounded: an LRU by bytes held (pieces at 8 bytes a token plus a fixed overhead per entry).
Hits and misses (chunks and bytes) feed ``kvroute_sizing_chunk_cache_*``.

Pure: no I/O, no asyncio. Thread-safe: sizing threads and the event loop share one cache.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.core.chain_hash import Piece, piece_of
from proxy.core.chunk_cuts import DEFAULT_RULE, CutRule, cut_points
from proxy.core.chunk_tails import Tail, TailMemo

Ids = npt.NDArray[np.uint32]
#: Byte length of each token id's text (UTF-8), indexed by id.
TokenBytes = npt.NDArray[np.int64]
#: A tokenizer's ids of one chunk (the caller's encoder, ids as a uint32 buffer).
EncodeChunk = Callable[[str], Ids]

#: Texts shorter than this are encoded whole (a chunk lookup would cost more than it saves).
CHUNK_ABOVE_CHARS = 8192
#: ``first_chunk_new`` looks for the first cut within this many characters.
FIRST_CUT_WITHIN_CHARS = 32_768
#: What an entry costs beyond its piece: key tuple, array header, LRU links (measured ~180 B).
ENTRY_OVERHEAD_BYTES = 200


def _chunk_key_fast(tokenizer: str, chunk: bytes) -> Hashable:
    return (tokenizer, hash(chunk), len(chunk))


def _chunk_key_digest(tokenizer: str, chunk: bytes) -> Hashable:
    return (tokenizer, hashlib.blake2b(chunk, digest_size=16).digest())


#: With a fixed hash seed anyone could craft colliding chunks: use a digest then.
chunk_key: Callable[[str, bytes], Hashable] = (
    _chunk_key_fast if sys.flags.hash_randomization else _chunk_key_digest
)


class ChunkCache:
    """LRU of chunk pieces by (tokenizer, chunk), bounded by bytes held; shared across threads."""

    def __init__(self, max_bytes: int = 64 << 20, rule: CutRule = DEFAULT_RULE) -> None:
        self.max_bytes = max_bytes
        self.rule = rule
        self._lengths: dict[str, TokenBytes] = {}
        self._lru: OrderedDict[Hashable, Piece] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        #: Chunks found / encoded, and the bytes of each (hit rate by work saved).
        self.hits = 0
        self.misses = 0
        self.hit_bytes = 0
        self.miss_bytes = 0
        #: Texts after their first cut, joined: a known document behind a new head in two pieces.
        self.tails = TailMemo(max_bytes // 4, chunk_key)

    @property
    def held_bytes(self) -> int:
        return self._held + self.tails.held_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def count(self, tokenizer: str, encode: EncodeChunk, text: str) -> int:
        return sum(p.size for p in self.pieces(tokenizer, encode, text))

    def pieces(self, tokenizer: str, encode: EncodeChunk, text: str) -> list[Piece]:
        """The pieces of ``text``'s chunks in order (one when it is not cut), exact."""
        data = text.encode("utf-8", "surrogatepass")
        tail = (
            self.tails.find(tokenizer, data, self.rule) if len(text) >= CHUNK_ABOVE_CHARS else None
        )
        if tail is not None and tail.piece is not None:
            head = self._head(tokenizer, encode, _Slicer(text, data), tail)
            if head is not None:
                return [head, tail.piece]
        cuts = cut_points(data, self.rule) if len(text) >= CHUNK_ABOVE_CHARS else []
        if not cuts:
            spend(len(data))
            return [piece_of(encode(text))]
        bounds = [0, *cuts, len(data)]
        keys = [chunk_key(tokenizer, data[a:b]) for a, b in itertools.pairwise(bounds)]
        parts = self._get_all(keys)
        missing = [i for i, p in enumerate(parts) if p is None]
        new_bytes = sum(bounds[i + 1] - bounds[i] for i in missing)
        piece = _Slicer(text, data)
        if new_bytes > _left():
            # Counted nowhere yet: the lookups are done again once the job has run.
            raise TooMuchToEncode(self._job(tokenizer, encode, piece, bounds, keys, missing))
        spend(new_bytes)
        self._count(len(keys) - len(missing), len(data) - new_bytes, len(missing), new_bytes)
        if missing:
            for run in _runs(missing):
                got = _encode_run(
                    encode, piece, bounds[run[0] : run[-1] + 2], self.lengths(tokenizer)
                )
                for i, ids in zip(run, got, strict=True):
                    parts[i] = self._put(keys[i], ids)
        out = [p for p in parts if p is not None]
        if tail is not None and tail.cut == bounds[1]:
            self.tails.offer(tail, keys[0], out[1:])
        return out

    def _head(
        self, tokenizer: str, encode: EncodeChunk, piece: _Slicer, tail: Tail
    ) -> Piece | None:
        """The first chunk's piece before a known tail (encoded if new); None: over the budget."""
        key = chunk_key(tokenizer, piece.data[: tail.cut])
        with self._lock:
            got = self._lru.get(key)
            if got is not None:
                self._lru.move_to_end(key)
        tail_bytes = len(piece.data) - tail.cut
        if got is not None:
            self._count(tail.chunks + 1, len(piece.data), 0, 0)
            return got
        if tail.cut > _left():
            return None  # the whole path makes the job for a sizing thread
        spend(tail.cut)
        self._count(tail.chunks, tail_bytes, 1, tail.cut)
        return self._put(key, encode(piece(0, tail.cut)))

    def _job(
        self,
        tokenizer: str,
        encode: EncodeChunk,
        piece: _Slicer,
        bounds: list[int],
        keys: list[Hashable],
        missing: list[int],
    ) -> EncodeJob:
        runs = _runs(missing)
        return EncodeJob(
            self,
            tokenizer,
            encode,
            [piece(bounds[r[0]], bounds[r[-1] + 1]) for r in runs],
            [bounds[r[0] : r[-1] + 2] for r in runs],
            [[keys[i] for i in r] for r in runs],
        )

    def first_chunk_new(self, tokenizer: str, text: str) -> bool:
        """``text``'s first chunk is missing from the cache (only looked at: nothing counted or moved).

        Its first cut depends on its first bytes only, so only those are cut (a text with
        no cut there is one chunk so far: new unless the whole text is held).
        """
        head = text[:FIRST_CUT_WITHIN_CHARS].encode("utf-8", "surrogatepass")
        cuts = cut_points(head, self.rule) if len(text) >= CHUNK_ABOVE_CHARS else []
        if not cuts and len(text) > FIRST_CUT_WITHIN_CHARS:
            # No cut early on (a cut there must leave a chunk's length behind it): all of it.
            head = text.encode("utf-8", "surrogatepass")
            cuts = cut_points(head, self.rule)
        first = head[: cuts[0]] if cuts else head
        with self._lock:
            return chunk_key(tokenizer, first) not in self._lru

    def lengths(self, tokenizer: str) -> TokenBytes | None:
        """The byte-length table of ``tokenizer``'s tokens, if its counter gave one (``teach``)."""
        return self._lengths.get(tokenizer)

    def teach(self, tokenizer: str, table: TokenBytes) -> None:
        """Give the cache ``tokenizer``'s byte length per token id (splits runs: see the module)."""
        self._lengths[tokenizer] = table

    def _get_all(self, keys: list[Hashable]) -> list[Piece | None]:
        out: list[Piece | None] = []
        with self._lock:
            lru = self._lru
            for key in keys:
                got = lru.get(key)
                if got is not None:
                    lru.move_to_end(key)
                out.append(got)
        return out

    def _count(self, hits: int, hit_bytes: int, misses: int, miss_bytes: int) -> None:
        with self._lock:
            self.hits += hits
            self.hit_bytes += hit_bytes
            self.misses += misses
            self.miss_bytes += miss_bytes

    def _put(self, key: Hashable, ids: Ids) -> Piece:
        """Keep the chunk's piece (made from its ids); returns it, kept or not."""
        piece = piece_of(ids)
        cost = piece.nbytes + ENTRY_OVERHEAD_BYTES
        if cost > self.max_bytes:
            return piece
        # Read-only: the same array is handed to every later request that meets the chunk.
        piece.flags.writeable = False
        with self._lock:
            if key in self._lru:
                return piece
            self._lru[key] = piece
            self._held += cost
            while self._held > self.max_bytes and self._lru:
                _, old = self._lru.popitem(last=False)
                self._held -= old.nbytes + ENTRY_OVERHEAD_BYTES
        return piece


@dataclass
class EncodeJob:
    """New chunks of one text, to encode in a sizing thread and store from the event loop.

    ``run`` makes only the encode calls (one per run of new chunks next to each other), so
    the thread retakes the GIL once per run; ``store`` splits and caches the ids where the
    GIL is already held. Then sizing the request again finds every chunk.
    """

    cache: ChunkCache
    tokenizer: str
    encode: EncodeChunk
    texts: list[str]
    bounds: list[list[int]]
    keys: list[list[Hashable]]

    def run(self) -> list[Ids]:
        return [self.encode(t) for t in self.texts]

    def store(self, encoded: list[Ids]) -> bool:
        """Cache each run's chunks; False when a run could not be split at its chunks."""
        lengths = self.cache.lengths(self.tokenizer)
        for ids, bounds, keys in zip(encoded, self.bounds, self.keys, strict=True):
            ends = [b - bounds[0] for b in bounds[1:]]
            split = [ids.copy()] if len(keys) == 1 else None
            if split is None and lengths is not None:
                split = split_at_bytes(ids, ends, lengths)
            if split is None:
                return False
            for key, part in zip(keys, split, strict=True):
                self.cache._put(key, part)
        return True


class TooMuchToEncode(Exception):
    """More new text than the calling thread's ``inline_budget`` allows: size it elsewhere.

    ``job``, when given, encodes what was missing (``EncodeJob``); else size it all elsewhere.
    """

    def __init__(self, job: EncodeJob | None = None) -> None:
        super().__init__("more new text than the inline budget")
        self.job = job


_local = threading.local()


class inline_budget:
    """Within this scope the calling thread may encode at most ``max_bytes`` of new text.

    A plain class (as ``proxy.core.digest.memo``): entered once per big request.
    """

    __slots__ = ("_max", "_outer")

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes

    def __enter__(self) -> None:
        self._outer = getattr(_local, "left", None)
        _local.left = self._max

    def __exit__(self, *exc: object) -> None:
        _local.left = self._outer


def _left() -> float:
    left: int | None = getattr(_local, "left", None)
    return float("inf") if left is None else left


def spend(size: int) -> None:
    """Charge ``size`` bytes of encoding to the thread's budget; raise when it runs out."""
    left: int | None = getattr(_local, "left", None)
    if left is None:
        return
    if size > left:
        raise TooMuchToEncode()
    _local.left = left - size


class _Slicer:
    """Text between two byte offsets, without decoding when the text is ASCII."""

    def __init__(self, text: str, data: bytes) -> None:
        self.text, self.data, self.ascii = text, data, text.isascii()

    def __call__(self, a: int, b: int) -> str:
        return self.text[a:b] if self.ascii else self.data[a:b].decode("utf-8", "surrogatepass")


def _runs(indexes: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indexes: [1, 2, 3, 7, 8] -> [[1, 2, 3], [7, 8]]."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _encode_run(
    encode: EncodeChunk, piece: _Slicer, bounds: list[int], lengths: TokenBytes | None
) -> list[Ids]:
    """The ids of each chunk between consecutive ``bounds``: one encode, split by byte lengths."""
    if len(bounds) == 2 or lengths is None:
        return [encode(piece(a, b)).copy() for a, b in itertools.pairwise(bounds)]
    ids = encode(piece(bounds[0], bounds[-1]))
    split = split_at_bytes(ids, [b - bounds[0] for b in bounds[1:]], lengths)
    if split is None:
        return [encode(piece(a, b)).copy() for a, b in itertools.pairwise(bounds)]
    return split


def split_at_bytes(ids: Ids, ends: list[int], lengths: TokenBytes) -> list[Ids] | None:
    """``ids`` cut where the bytes they stand for reach each of ``ends``; None if one falls inside a token."""
    if ids.size == 0 or int(ids.max()) >= lengths.size:
        return None
    cum = np.cumsum(lengths[ids], dtype=np.int64)
    want = np.asarray(ends, dtype=np.int64)
    if int(cum[-1]) != ends[-1]:
        return None
    at = np.searchsorted(cum, want[:-1])
    if at.size and (int(at.max()) >= cum.size or not np.array_equal(cum[at], want[:-1])):
        return None
    return [p.copy() for p in np.split(ids, at + 1)]
