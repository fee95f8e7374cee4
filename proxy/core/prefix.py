"""Where a prompt's prefix is probably cached: chained block hashes and a bounded index per backend.

vLLM's prefix cache keys each *full* KV block by a hash of (its parent block's hash, its own
token ids), so a block's hash names the whole prefix up to its end and two prompts share a
cached block exactly when they share every token before it. kvroute's hashes name prefixes
the same way (``proxy.core.chain_hash``). The gateway cannot see a server's cache, so it
keeps its own approximation: when a request is
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
  than ``max_blocks_per_node`` hashes per node (least recently used go first; within one
  prompt the last blocks first, as vLLM frees a finished request's blocks in reverse order
  "so that the tail blocks are evicted first").

Why a match looks up ~12 blocks, not every block: the index keeps one invariant, *a block
it holds has its whole prefix held, at least as fresh* (a prompt's blocks are recorded
together, at one time, the tail least recently used; no write lowers a block's time). So
"block i is held and fresh" is true for a leading run of a prompt's blocks and false after
it, and a binary search finds where it turns (``_leading``). Scanning every block, as before,
cost ~1 ms per node for a 50k-token prompt (3,100 dict lookups), per request, on the loop;
recording it another ~1.5 ms, now two C-level passes (``record``).

Pure: no I/O, no clock (time comes in as an argument).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat

from proxy.core.chain_hash import block_hashes

__all__ = ["PrefixIndex", "PrefixIndexConfig", "block_hashes"]


#: A prompt recorded again within this fraction of its age limit is not rewritten...
REFRESH_FRACTION = 1 / 32
#: ...nor more than this long after (KV-cache events trust placements of the last 5 s, by
#: default). 4 s, not 2: a document resent all the time is rewritten half as often, ~2.5% of
#: the CPU of 220 KB prompts at 150 connections (64 documents, ~1.7 ms a rewrite).
REFRESH_MAX_S = 4.0


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    """How long and how much the index remembers (config: ``routing.prefix``)."""

    block_tokens: int = 16
    ttl_s: float = 600.0
    pressure_ttl_s: float = 30.0
    max_blocks_per_node: int = 200_000


@dataclass(slots=True)
class _Node:
    # hash -> last time it was placed; insertion order is recency (LRU first). A plain dict,
    # not an OrderedDict: a block is made recent by popping and inserting it again, and C-level
    # passes over a prompt's blocks cost ~1/4 of the OrderedDict's (its links per entry).
    blocks: dict[int, float] = field(default_factory=dict)
    limit: int = 0  # 0: only the config's bound
    pressured: bool = False
    # The latest time any block was recorded at: a write at or after it lowers no block's time.
    newest: float = float("-inf")


class PrefixIndex:
    """Per-backend LRU of block hashes the backend probably holds in its prefix cache."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._nodes: dict[str, _Node] = {}

    def record(self, node: str, hashes: Iterable[int], now: float) -> None:
        """``node`` was given a request with these prompt blocks: it holds them afterwards.

        The blocks become the most recently used, the last of them least so (evicted first).
        A placement older than one already recorded (another replica's, shared ~0.1 s late)
        is recorded at the newest time this node has seen: no block is made older, and
        such a block lives at most the share's delay longer.
        """
        entry = self._nodes.setdefault(node, _Node())
        blocks = entry.blocks
        chain = hashes if isinstance(hashes, (tuple, list)) else tuple(hashes)
        if chain and self._fresh_whole(entry, chain[-1], now):
            return
        now = entry.newest = max(now, entry.newest)
        # Two C-level passes (no Python loop per block): take them out, put them back at the
        # most recent end, tail first.
        deque(map(blocks.pop, chain, repeat(None)), maxlen=0)
        blocks.update(zip(reversed(chain), repeat(now)))
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
        return _leading(entry.blocks, hashes, now - ttl)

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
            old: list[int] = []
            for h, seen in blocks.items():
                if now - seen <= ttl:
                    break
                old.append(h)
            deque(map(blocks.pop, old), maxlen=0)
            dropped += len(old)
        return dropped

    def forget(self, node: str) -> None:
        """A restarted or removed node has an empty cache."""
        self._nodes.pop(node, None)

    def size(self, node: str | None = None) -> int:
        if node is not None:
            entry = self._nodes.get(node)
            return len(entry.blocks) if entry is not None else 0
        return sum(len(e.blocks) for e in self._nodes.values())

    def _fresh_whole(self, entry: _Node, tail: int, now: float) -> bool:
        """The prompt ending in ``tail`` is held whole, recorded within the refresh window.

        Then recording it again is skipped: its blocks expire at most that much early and
        keep their place in the LRU; a document resent many times a second costs one lookup
        per request instead of rewriting its ~3,100 blocks (~1.5 ms for 50k tokens).
        """
        seen = entry.blocks.get(tail)
        window = min(self._ttl(entry) * REFRESH_FRACTION, REFRESH_MAX_S)
        return seen is not None and now - seen <= window

    def _ttl(self, entry: _Node) -> float:
        c = self.config
        return min(c.ttl_s, c.pressure_ttl_s) if entry.pressured else c.ttl_s

    def _trim(self, entry: _Node) -> None:
        bound = self.config.max_blocks_per_node
        if entry.limit:
            bound = min(bound, entry.limit)
        blocks = entry.blocks
        over = len(blocks) - bound
        if over > 0:
            # The least recently used, in one C-level pass.
            deque(map(blocks.pop, list(islice(blocks, over))), maxlen=0)


def _leading(blocks: dict[int, float], hashes: Sequence[int], oldest: float) -> int:
    """How many leading ``hashes`` are held at ``oldest`` or later (a binary search).

    Exact under the index's invariant (module docstring): held-and-fresh is a leading run.
    The common answers cost one or two lookups: all of them (a prompt sent again), none.
    """
    n = len(hashes)

    def held(i: int) -> bool:
        seen = blocks.get(hashes[i])
        return seen is not None and seen >= oldest

    if held(n - 1):
        return n
    if not held(0):
        return 0
    # held(lo) and not held(hi): the run ends between them.
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if held(mid):
            lo = mid
        else:
            hi = mid
    return hi
