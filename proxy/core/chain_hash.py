"""kvroute's chained block hashes, defined so that a text's share is computed once and reused anywhere.

vLLM's prefix cache keys each full KV block by a hash of its parent's hash and its own ids,
so a block's hash names the whole prefix up to its end. kvroute's hashes name prefixes the
same way, by a polynomial over the prompt's ids (mod 2**64, ``B`` odd):

1. each id becomes a pseudo-random 64-bit value ``m = mix(id + seed)`` (splitmix64's mixer);
2. the prefix of k tokens has ``R_k = m_0 B^(k-1) + m_1 B^(k-2) + ... + m_(k-1)``;
3. block i's hash is murmur3's 64-bit finalizer of ``R_k + k * golden``, k = (i+1) * block.

Why a polynomial: a prefix followed by a piece of L tokens has ``R = R_prefix * B^L +
R_piece``, where ``R_piece`` is the piece's own value as if it began the prompt. A text's
running values (a ``Piece``: ``R`` after each of its tokens, from 0) therefore do not depend
on where the text sits, and the chunk cache keeps them instead of ids
(``proxy.core.chunk_count``): a known document behind a new question gets its ~3,100 block
hashes from its cached pieces in a few vectorized passes over the block ends, with no pass
over its 50,000 ids. v2 was a running sum of position-mixed ids: every id was mixed again
whenever the head's length changed (those passes alone were 20% of the event loop's time in
the shared-document benchmark).

Collisions: two different prefixes of equal length differ in some ``m``; their ``R`` agree
with probability about 2**-64 for ids that are not chosen to collide (``B`` is odd, so
``B^j`` is invertible and each ``m`` reaches every value). A crafted collision is possible
(this is no cryptographic hash), but all it buys is a routing preference for a node that
lacks the prefix; nothing cached is served from these hashes.

The values are new in v3 ("kvroute3" seed): replicas of different versions sharing one
Redis index do not match each other's hashes until all are upgraded (affinity only).

Pure: no I/O. Thread-safe (the power table only ever grows, by replacement).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

#: A text's running values: element j is ``R`` of its first j + 1 tokens, as if it began a prompt.
Piece = npt.NDArray[np.uint64]

_MASK = (1 << 64) - 1
_SEED = np.uint64(0x6B76_726F_7574_6533)  # "kvroute3"
_B = 0x9FB2_1C65_1E98_DF25
_B_INV = pow(_B, -1, 1 << 64)
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_M1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_M2 = np.uint64(0x94D0_49BB_1331_11EB)
_F1 = np.uint64(0xFF51_AFD7_ED55_8CCD)
_F2 = np.uint64(0xC4CE_B9FE_1A85_EC53)
_S27, _S30, _S31, _S33 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(33)
#: Pieces are built in segments this long (the inverse powers' table is this long).
_SEGMENT = 8192


def _powers(base: int, n: int) -> npt.NDArray[np.uint64]:
    """``base**0 .. base**(n-1)`` mod 2**64 (uint64 products wrap, as intended)."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    np.cumprod(out, out=out)
    return out


_INV = _powers(_B_INV, _SEGMENT)
_pow = _powers(_B, _SEGMENT + 1)


def _pow_table(n: int) -> npt.NDArray[np.uint64]:
    """``B**0 .. B**n`` at least: grown (doubling) for longer pieces, never shrunk."""
    global _pow
    table = _pow
    if table.size <= n:
        table = _powers(_B, max(n + 1, 2 * table.size))
        _pow = table
    return table


def as_uint64(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.uint64]:
    """Token ids as unsigned 64-bit values; ``ValueError`` when they are not non-negative ints."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype in (np.uint32, np.uint64):
        return token_ids.astype(np.uint64, copy=False)
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        raw = np.frombuffer(token_ids, dtype=np.int64)
    else:
        try:
            raw = np.asarray(token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"token ids are not 64-bit integers: {e}") from None
    if raw.ndim != 1 or bool((raw < 0).any()):
        raise ValueError("token ids must be a flat list of non-negative integers")
    return raw.view(np.uint64)


def piece_of(token_ids: Sequence[int] | npt.NDArray[np.integer], carry: int = 0) -> Piece:
    """Running values ``R`` after each of ``token_ids``, continuing a prefix whose value is ``carry``.

    With ``carry`` 0 this is the ids' ``Piece``. Built per segment: within one,
    ``R_j = B^j * sum(m_p * B^-p)`` is a cumulative sum between two multiplications.
    """
    v = as_uint64(token_ids) + _SEED  # a fresh array: mixed in place below
    v ^= v >> _S30
    v *= _M1
    v ^= v >> _S27
    v *= _M2
    v ^= v >> _S31
    for a in range(0, v.size, _SEGMENT):
        seg = v[a : a + _SEGMENT]
        n = seg.size
        seg *= _INV[:n]
        np.cumsum(seg, out=seg)
        seg *= _pow[:n]
        if carry:
            seg += np.uint64(carry) * _pow[1 : n + 1]
        carry = int(seg[-1])
    return v


def finish(values: npt.NDArray[np.uint64], ends: npt.NDArray[np.uint64]) -> list[int]:
    """Block hashes from ``R`` at block ends and the token counts ``k`` there (step 3)."""
    h = ends * _GOLDEN
    h += values
    h ^= h >> _S33
    h *= _F1
    h ^= h >> _S33
    h *= _F2
    h ^= h >> _S33
    out: list[int] = h.tolist()
    return out


def block_hashes(token_ids: Sequence[int], block_tokens: int, max_blocks: int = 0) -> list[int]:
    """Hashes (unsigned 64-bit) of each *full* block of ``block_tokens`` tokens, first block first.

    Equal hashes at position i mean equal prompts up to the end of block i; a change in
    block j changes every hash from j on. A trailing partial block is not hashed (servers do
    not share partial blocks). ``max_blocks`` > 0 stops after that many blocks. Ids that are
    not token ids (a client's odd completions prompt) have no blocks.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    n = len(token_ids) // block_tokens
    if max_blocks > 0:
        n = min(n, max_blocks)
    if n == 0:
        return []
    k = n * block_tokens
    try:
        running = piece_of(token_ids[:k])
    except ValueError:
        return []
    return finish(running[block_tokens - 1 :: block_tokens], _ends(k, block_tokens))


def pieces_hashes(pieces: Sequence[Piece], block_tokens: int, max_tokens: int = 0) -> list[int]:
    """``block_hashes`` of the ids the pieces stand for, one after another, from the pieces alone.

    ``max_tokens`` > 0 hashes only that many leading tokens. For each block end inside piece
    i (starting at token s_i): ``R = G_i * B^(j+1) + piece_i[j]``, j = end - 1 - s_i, where
    ``G_i`` is ``R`` of everything before the piece (one step per piece: ``G * B^L + last``).
    """
    return pieces_hashes_from(pieces, block_tokens, max_tokens)[0]


#: Where a prompt's chain stands after some of its tokens: (``R`` of them, how many).
ChainAt = tuple[int, int]


def pieces_hashes_from(
    pieces: Sequence[Piece], block_tokens: int, max_tokens: int = 0, at: ChainAt = (0, 0)
) -> tuple[list[int], ChainAt]:
    """``pieces_hashes`` of pieces that follow a prefix standing at ``at``, and where they end.

    The hashes are those of the block ends after the prefix's tokens (a block the prefix
    left partial is finished by the pieces). With the prefix's own hashes in front they are
    the whole prompt's: a prompt that extends one hashed before (a chat's next turn, the
    same body again) hashes only its new pieces (``proxy.core.hash_memo``).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    bt = block_tokens
    cap = max_tokens if max_tokens > 0 else 1 << 62
    starts: list[int] = []
    carries: list[int] = []
    counts: list[int] = []
    picks: list[Piece] = []
    g, s = at
    begin = s
    # B^L per piece from the table (Python's pow(B, L, 2**64) cost ~1 us a piece).
    table = _pow_table(max((p.size for p in pieces), default=0))
    for p in pieces:
        if s >= cap:
            break
        if p.size > cap - s:
            p = p[: cap - s]
        size = p.size
        if size == 0:
            continue
        first = (-(s + 1)) % bt
        if first < size:
            pick = p[first::bt]
            picks.append(pick)
            counts.append(pick.size)
            starts.append(s)
            carries.append(g)
        g = (g * table.item(size) + p.item(-1)) & _MASK
        s += size
    if not picks:
        return [], (g, s)
    ends = np.arange((begin // bt + 1) * bt, s // bt * bt + 1, bt, dtype=np.uint64)
    if len(picks) == 1:  # every block end in one piece (a lone text, or one behind a short head)
        values = picks[0].copy()
        if carries[0]:
            values += np.uint64(carries[0]) * table[(ends - np.uint64(starts[0])).astype(np.intp)]
        return finish(values, ends), (g, s)
    values = np.concatenate(picks)
    count = np.asarray(counts)
    offsets = ends - np.repeat(np.asarray(starts, dtype=np.uint64), count)
    lead = np.repeat(np.asarray(carries, dtype=np.uint64), count)
    lead *= table[offsets.astype(np.intp)]
    values += lead
    return finish(values, ends), (g, s)


def joined(pieces: Sequence[Piece]) -> Piece:
    """The pieces as one: ``R`` after every token of their ids in order (joined tails; tests)."""
    out: list[Piece] = []
    g = 0
    for p in pieces:
        if p.size == 0:
            continue
        q = p.copy()
        if g:
            q += np.uint64(g) * _pow_table(p.size)[1 : p.size + 1]
        out.append(q)
        g = int(q[-1])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


def _ends(stop: int, block_tokens: int) -> npt.NDArray[np.uint64]:
    """Token counts at every block end up to ``stop``."""
    return np.arange(block_tokens, stop + 1, block_tokens, dtype=np.uint64)
