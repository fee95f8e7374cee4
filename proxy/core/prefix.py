"""Where a prompt's prefix is probably cached: chained block hashes and a bounded index per backend.

vLLM's prefix cache keys each *full* KV block by a hash of (its parent block's hash, its own
token ids), so a block's hash names the whole prefix up to its end and two prompts share a
cached block exactly when they share every token before it. The gateway cannot see a
server's cache, so it keeps its own approximation built the same way: when a request is
placed on a node, the node is assumed to hold that request's prompt blocks afterwards.

The gateway's token ids are its own rendering of the prompt (it does not apply the model's
chat template), so its block boundaries are not the server's: the index answers "which node
most likely holds most of this prefix", never "which exact blocks are cached". That is all
routing needs.

Forgetting, because a server evicts:

* by age: an entry not touched for ``ttl_s`` is gone (an idle cached block is the first
  a busy server reuses);
* by pressure: a node that is queueing, preempting or nearly full evicts its free cached
  blocks quickly, so there entries expire after ``pressure_ttl_s`` instead;
* by size: a node cannot cache more than its KV capacity, and the index never holds more
  than ``max_blocks_per_node`` hashes per node (least recently used go first).

Pure: no I/O, no clock (time comes in as an argument).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# Fixed odd 64-bit constants (splitmix64's increment and multipliers, murmur3's finalizer):
# the hashes must be the same in every process, since replicas share them through Redis.
_SEED = np.uint64(0x6B76_726F_7574_6532)  # "kvroute2": not v1's BLAKE2b values
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_M1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_M2 = np.uint64(0x94D0_49BB_1331_11EB)
_F1 = np.uint64(0xFF51_AFD7_ED55_8CCD)
_F2 = np.uint64(0xC4CE_B9FE_1A85_EC53)
_S30, _S27, _S31, _S33 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(33)


def block_hashes(token_ids: Sequence[int], block_tokens: int, max_blocks: int = 0) -> list[int]:
    """Hashes (unsigned 64-bit) of each *full* block of ``block_tokens`` tokens, first block first.

    Block i's hash names the whole prompt up to the end of block i, as vLLM's chained block
    hashes do: equal hashes at position i mean equal prompts up to there, and a change in
    block j changes every hash from j on. A trailing partial block is not hashed (servers
    do not share partial blocks). ``max_blocks`` > 0 stops after that many blocks.

    How, and why not a chain of BLAKE2b calls (v1): that was one Python-level call per
    16-token block, ~2 ms of a worker thread holding the GIL per 30k-token prompt, which
    the event loop waited out (issue 12's loop lag). Here, vectorized (numpy, which releases
    the GIL inside its loops; ~0.2 ms for 30k ids):

    1. each (position, id) pair becomes a pseudo-random 64-bit value ``v_p`` (splitmix64's
       mixer of ``id + seed + p * golden``);
    2. the prefix value at k tokens is ``S_k = v_0 + ... + v_{k-1}`` mod 2**64 (a cumulative
       sum: it depends on every id before k and on nothing after);
    3. block i's hash is murmur3's 64-bit finalizer of ``S_k + k * golden``, k = (i+1) * block.

    Collisions: for two different prefixes of equal length, ``S_k`` differs by a sum of
    differences of independent-looking 64-bit values, so they agree with probability about
    2**-64 per comparison; an index of 10**6 blocks meets a false match about once in 10**13
    lookups. A crafted collision is possible (this is no cryptographic hash), but all it buys
    is a routing preference for a node that lacks the prefix (a slower first token on the
    attacker's own request); nothing cached is served from the gateway's hashes.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    n = len(token_ids) // block_tokens
    if max_blocks > 0:
        n = min(n, max_blocks)
    if n == 0:
        return []
    k = n * block_tokens
    ids = _as_uint64(token_ids, k)
    if ids is None:
        return []
    out: list[int] = _block_ends(_prefix_sums(ids), block_tokens, n).tolist()
    return out


def _as_uint64(token_ids: Sequence[int], k: int) -> npt.NDArray[np.uint64] | None:
    """The first ``k`` ids as unsigned 64-bit values; None when they are not token ids."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        # The gateway's ids (proxy.core.prefix_prompt) already are 64-bit: no copy.
        return np.frombuffer(token_ids, dtype=np.uint64, count=k)
    try:
        ids = np.array(token_ids[:k], dtype=np.int64).view(np.uint64)
    except (OverflowError, TypeError, ValueError):
        # Not token ids after all (a client's odd completions prompt): nothing to match on.
        return None
    return ids if ids.shape == (k,) else None


def _prefix_sums(ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Steps 1-2: each (position, id) mixed to ``v_p``; then ``S_k``, their running sum."""
    # uint64 arithmetic wraps mod 2**64, as intended (numpy does not warn for arrays).
    v = np.arange(len(ids), dtype=np.uint64)
    v *= _GOLDEN
    v += ids
    v += _SEED
    v ^= v >> _S30
    v *= _M1
    v ^= v >> _S27
    v *= _M2
    v ^= v >> _S31
    np.cumsum(v, out=v)
    return v


def _block_ends(sums: npt.NDArray[np.uint64], block_tokens: int, n: int) -> npt.NDArray[np.uint64]:
    """Step 3: each block's hash, the finalizer of ``S_k + k * golden`` at its last token."""
    h = sums[block_tokens - 1 :: block_tokens].copy()
    ends = np.arange(1, n + 1, dtype=np.uint64)
    ends *= np.uint64(block_tokens)
    ends *= _GOLDEN
    h += ends
    h ^= h >> _S33
    h *= _F1
    h ^= h >> _S33
    h *= _F2
    h ^= h >> _S33
    return h


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    """How long and how much the index remembers (config: ``routing.prefix``)."""

    block_tokens: int = 16
    ttl_s: float = 600.0
    pressure_ttl_s: float = 30.0
    max_blocks_per_node: int = 200_000


@dataclass(slots=True)
class _Node:
    # hash -> last time it was placed or matched; insertion order is recency (LRU first).
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)
    limit: int = 0  # 0: only the config's bound
    pressured: bool = False


class PrefixIndex:
    """Per-backend LRU of block hashes the backend probably holds in its prefix cache."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._nodes: dict[str, _Node] = {}

    def record(self, node: str, hashes: Iterable[int], now: float) -> None:
        """``node`` was given a request with these prompt blocks: it holds them afterwards."""
        entry = self._nodes.setdefault(node, _Node())
        blocks = entry.blocks
        for h in hashes:
            blocks[h] = now
            blocks.move_to_end(h)
        self._trim(entry)

    def match(
        self, node: str, hashes: Sequence[int], now: float, max_age_s: float | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` ``node`` probably still holds (touches them).

        ``max_age_s``: only blocks placed that recently (placements whose KV-cache events may
        not have arrived yet, ``proxy.gateway.affinity``)."""
        entry = self._nodes.get(node)
        if entry is None or not hashes:
            return 0
        ttl = self._ttl(entry) if max_age_s is None else min(self._ttl(entry), max_age_s)
        blocks = entry.blocks
        matched = 0
        for h in hashes:
            seen = blocks.get(h)
            if seen is None or now - seen > ttl:
                # Chained: a missing block means nothing after it can be a cached prefix.
                break
            matched += 1
        return matched

    def touch(self, node: str, hashes: Sequence[int], now: float) -> None:
        """Mark blocks as used again (a request reusing them keeps them warm on the server)."""
        self.record(node, hashes, now)

    def observe(self, node: str, capacity_tokens: int, pressured: bool) -> None:
        """Take in a node's report: its cache can hold no more than its capacity, pressure evicts."""
        entry = self._nodes.setdefault(node, _Node())
        entry.limit = max(0, capacity_tokens // self.config.block_tokens)
        entry.pressured = pressured
        self._trim(entry)

    def expire(self, now: float) -> int:
        """Drop entries past their age limit (the least recently used first); returns how many."""
        dropped = 0
        for entry in self._nodes.values():
            ttl = self._ttl(entry)
            blocks = entry.blocks
            while blocks:
                h, seen = next(iter(blocks.items()))
                if now - seen <= ttl:
                    break
                del blocks[h]
                dropped += 1
        return dropped

    def forget(self, node: str) -> None:
        """A restarted or removed node has an empty cache."""
        self._nodes.pop(node, None)

    def size(self, node: str | None = None) -> int:
        if node is not None:
            entry = self._nodes.get(node)
            return len(entry.blocks) if entry is not None else 0
        return sum(len(e.blocks) for e in self._nodes.values())

    def _ttl(self, entry: _Node) -> float:
        c = self.config
        return min(c.ttl_s, c.pressure_ttl_s) if entry.pressured else c.ttl_s

    def _trim(self, entry: _Node) -> None:
        bound = self.config.max_blocks_per_node
        if entry.limit:
            bound = min(bound, entry.limit)
        blocks = entry.blocks
        while len(blocks) > bound:
            blocks.popitem(last=False)
