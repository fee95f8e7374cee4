"""The simulated vLLM's automatic prefix cache: full prompt blocks kept by hash, shared, evictable.

As vLLM's block manager does (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``): each
full block of a prompt is named by a hash chained over its parent, so a new request reuses
the longest run of leading blocks already present. A block held by a running request is
shared (reference counted: it costs the newcomer nothing); a block whose last holder ended
stays cached in the free pool and is reused for free if asked for before the allocator hands
it out again (least recently freed first; a request's blocks are freed tail first, so a
prompt's end is evicted before its start). Cached tokens skip prefill.

The engine renders the prompt its own way (role markers, then text), not the gateway's: the
gateway's prefix index must work from its own approximation, as it does against real servers.

With a ``listener`` (``kv_publisher``: ``--kv-events-config``), the cache tells what it stores
and evicts as vLLM's block pool does: newly computed blocks (with their parent's hash and
token ids) when a request acquires them, evicted ones when the allocator reuses them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from proxy.core.tokens import encoding

_ROOT = 0x6B76


def render(body: dict[str, Any]) -> list[str]:
    """The prompt as this engine's 'chat template' renders it, one text per message."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<|{m.get('role')}|>\n{content or ''}\n")
        return [*parts, "<|assistant|>\n"]
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], str):
        return [p[0]]
    return [p] if isinstance(p, str) else []


@functools.lru_cache(maxsize=256)
def _ids(text: str) -> tuple[int, ...]:
    # A shared document is resent with every question: tokenized once per engine process.
    return tuple(encoding().ids(text))


def prompt_block_hashes(body: dict[str, Any], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the rendered prompt's full blocks (token ids from cl100k)."""
    return prompt_blocks(body, block_size)[0]


def prompt_ids(body: dict[str, Any]) -> Sequence[int]:
    """The token ids this engine prefills for ``body``: its rendering, tokenized per piece."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return p
    return [t for part in render(body) for t in _ids(part)]


def prompt_blocks(body: dict[str, Any], block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chained hashes of the rendered prompt's full blocks, those blocks' token ids)."""
    ids = prompt_ids(body)
    out: list[int] = []
    parent = _ROOT
    n = len(ids) // block_size
    for i in range(n):
        parent = hash((parent, tuple(ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return tuple(out), tuple(ids[: n * block_size])


class CacheListener(Protocol):
    """Told what the cache stores and evicts (the KV-event publisher)."""

    def stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache:
    """Which block hashes are in the cache: pinned by running requests, or cached in free blocks."""

    def __init__(self, block_size: int = 16, listener: CacheListener | None = None) -> None:
        self.block_size = block_size
        self.listener = listener
        self.pinned: dict[int, int] = {}
        # Free blocks still holding content; the first is the next one the allocator reuses.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # Blocks running requests held when the cache was reset: freed uncached at their end.
        self.orphans: dict[int, int] = {}

    def lookup(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks present, how many of them are pinned: shared at no cost)."""
        hits = shared = 0
        for h in hashes:
            if h in self.pinned:
                shared += 1
            elif h not in self.evictable:
                break
            hits += 1
        return hits, shared

    def acquire(self, hashes: Sequence[int], token_ids: Sequence[int] = ()) -> None:
        """A request now holds these blocks (reused or newly computed)."""
        if self.listener is not None:
            self._tell_stored(hashes, token_ids)
        for h in hashes:
            n = self.pinned.get(h)
            if n is None:
                self.evictable.pop(h, None)
                self.pinned[h] = 1
            else:
                self.pinned[h] = n + 1

    def release(self, hashes: Sequence[int]) -> int:
        """A request let go of these blocks; returns how many became free (cached, evictable)."""
        freed = 0
        for h in reversed(hashes):
            if h not in self.pinned and h in self.orphans:
                left = self.orphans.pop(h) - 1
                if left > 0:
                    self.orphans[h] = left
                freed += left <= 0
                continue
            n = self.pinned.get(h, 0) - 1
            if n > 0:
                self.pinned[h] = n
                continue
            self.pinned.pop(h, None)
            self.evictable[h] = None
            self.evictable.move_to_end(h)
            freed += 1
        return freed

    def reset(self) -> int:
        """vLLM's ``/reset_prefix_cache``: no block is found by its hash any more.

        Cached free blocks are plain free blocks; blocks running requests hold stay theirs but
        are not shared with newcomers nor cached when freed. (vLLM resets only once no running
        request holds blocks, or preempts them first; here they run on, uncached.) Tells the
        listener ``AllBlocksCleared``. Returns how many cached free blocks were dropped.
        """
        dropped = len(self.evictable)
        self.evictable.clear()
        for h, n in self.pinned.items():
            self.orphans[h] = self.orphans.get(h, 0) + n
        self.pinned.clear()
        if self.listener is not None:
            self.listener.cleared()
        return dropped

    def trim(self, free_blocks: int) -> None:
        """Free blocks handed out for new content lose what they cached (LRU first)."""
        evicted: list[int] = []
        while len(self.evictable) > max(0, free_blocks):
            evicted.append(self.evictable.popitem(last=False)[0])
        if evicted and self.listener is not None:
            self.listener.removed(evicted)

    def _tell_stored(self, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Runs of blocks new to the cache, each as one stored event with its parent."""
        assert self.listener is not None
        bs = self.block_size
        i = 0
        while i < len(hashes):
            if hashes[i] in self.pinned or hashes[i] in self.evictable:
                i += 1
                continue
            j = i
            while (
                j < len(hashes) and hashes[j] not in self.pinned and hashes[j] not in self.evictable
            ):
                j += 1
            ids = token_ids[i * bs : j * bs]
            if len(ids) == (j - i) * bs:
                parent = hashes[i - 1] if i > 0 else None
                self.listener.stored(hashes[i:j], parent, ids, bs)
            i = j
