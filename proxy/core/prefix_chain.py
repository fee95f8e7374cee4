"""kvroute's chained block hashes, continued from a parent block instead of the prompt's start.

An engine's KV-cache events (``proxy.core.kv_events``) name a stored block by the engine's
own hash and its parent's, with only the new blocks' token ids. The exact index
(``proxy.core.exact_prefix``) keys blocks by kvroute's hash of the whole prefix so that a
request's hashes (``proxy.core.chain_hash``) look them up directly. That hash is a
polynomial over every token before a block's end, so the parent's value and length
(``ChainState``) are all it takes to continue the chain: no token ids are kept.

``extend(ROOT, ids, b)`` equals ``block_hashes(ids, b)`` for every input (a test holds the two
together); the engine's block size need not be kvroute's, a kvroute block ends wherever the
running length crosses a multiple of ``block_tokens``.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from proxy.core.chain_hash import finish, piece_of


class ChainState(NamedTuple):
    """The prefix's value ``R`` (mod 2**64) and token count at the end of a block."""

    total: int
    length: int


ROOT = ChainState(0, 0)


def extend(
    state: ChainState, token_ids: Sequence[int], block_tokens: int
) -> tuple[list[int], ChainState]:
    """kvroute's hashes of the blocks that end inside ``token_ids``, and the state after them.

    Raises ``ValueError`` for ids that are not non-negative 64-bit integers (a hostile event).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if len(token_ids) == 0:
        return [], state
    v = _running(state, token_ids)
    return _finish(v, state.length, block_tokens), ChainState(int(v[-1]), state.length + len(v))


def extend_blocks(
    state: ChainState, token_ids: Sequence[int], engine_block: int, block_tokens: int
) -> list[tuple[tuple[int, ...], ChainState]]:
    """Per engine block of ``engine_block`` ids: kvroute's hashes ending in it, and its state.

    One vectorized pass for the whole event (a 2,000-block store is one numpy pass, not
    2,000), then a walk that hands each engine block the kvroute blocks ending inside it.
    """
    if block_tokens < 1 or engine_block < 1:
        raise ValueError("block sizes must be positive")
    n = len(token_ids) // engine_block * engine_block
    if n == 0:
        return []
    v = _running(state, token_ids[:n])
    k0 = state.length
    own = _finish(v, k0, block_tokens)
    totals: list[int] = v[engine_block - 1 :: engine_block].tolist()
    if engine_block == block_tokens and k0 % block_tokens == 0:
        # Aligned blocks of one size (the usual case): one kvroute hash per engine block.
        ends = range(k0 + engine_block, k0 + n + 1, engine_block)
        return [((h,), ChainState(t, e)) for h, t, e in zip(own, totals, ends, strict=True)]
    first_end = k0 + (-(k0 + 1)) % block_tokens + 1
    out: list[tuple[tuple[int, ...], ChainState]] = []
    j = 0
    for i, total in enumerate(totals):
        end = k0 + (i + 1) * engine_block
        lo = j
        while j < len(own) and first_end + j * block_tokens <= end:
            j += 1
        out.append((tuple(own[lo:j]), ChainState(total, end)))
    return out


def _running(state: ChainState, token_ids: Sequence[int]) -> np.ndarray:
    """``R`` after each id, continuing ``state`` (``chain_hash``'s steps 1 and 2)."""
    return piece_of(token_ids, carry=state.total)


def _finish(v: np.ndarray, k0: int, block_tokens: int) -> list[int]:
    """Hashes of the kvroute blocks ending inside ``v`` (``chain_hash``'s step 3)."""
    first = (-(k0 + 1)) % block_tokens
    if first >= len(v):
        return []
    ends = np.arange(k0 + first + 1, k0 + len(v) + 1, block_tokens, dtype=np.uint64)
    return finish(v[first::block_tokens], ends)
