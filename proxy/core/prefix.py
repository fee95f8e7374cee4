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

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: The root's parent hash (vLLM uses a random seed per process; any constant serves here).
_ROOT = b"kvroute-prefix-v1"


def block_hashes(token_ids: Sequence[int], block_tokens: int, max_blocks: int = 0) -> list[int]:
    """Chained hashes of each *full* block of ``block_tokens`` tokens, first block first.

    Block i's hash covers block i-1's hash and block i's token ids, as vLLM's prefix cache
    does, so equal hashes at position i mean equal prompts up to the end of block i. A
    trailing partial block is not hashed (servers do not share partial blocks).
    ``max_blocks`` > 0 stops after that many blocks (bounds the work on huge prompts).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    n = len(token_ids) // block_tokens
    if max_blocks > 0:
        n = min(n, max_blocks)
    step = block_tokens * 8
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        # The gateway's ids (proxy.core.prefix_prompt) already are 64-bit: no copy.
        raw = memoryview(token_ids).cast("B")
    else:
        try:
            raw = memoryview(array("q", token_ids[: n * block_tokens]).tobytes())
        except (OverflowError, TypeError):
            # Not token ids after all (a client's odd completions prompt): nothing to match on.
            return []
    # One keyed BLAKE2b call per block, the parent's digest as the key: the chain costs
    # ~1 µs a block (a 30k-token prompt: ~1,900 blocks, the gateway's work per request).
    b2 = hashlib.blake2b
    to_int = int.from_bytes
    parent = _ROOT
    out: list[int] = []
    add = out.append
    for start in range(0, n * step, step):
        parent = b2(raw[start : start + step], digest_size=8, key=parent).digest()
        add(to_int(parent, "little"))
    return out


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

    def match(self, node: str, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` ``node`` probably still holds (touches them)."""
        entry = self._nodes.get(node)
        if entry is None or not hashes:
            return 0
        ttl = self._ttl(entry)
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
