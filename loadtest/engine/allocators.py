"""KV-cache allocator models: contiguous first-fit (fragments) and paged (does not).

Pure classes, no I/O and no clock: the simulated engine holds one per process, and the
offline fleet simulator drives millions of allocate/free calls through them, so both keep
their bookkeeping in sorted Python lists (bisect + C-level memmove) rather than trees.

Neither raises on "does not fit": ``allocate`` returns ``None``, because a failed
placement is an ordinary outcome here (it is the thing being studied), not an error.
Sizes are in tokens throughout.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Literal, Protocol, runtime_checkable

AllocatorKind = Literal["contiguous", "paged"]


@runtime_checkable
class Allocator(Protocol):
    """What the engine, the simulator and the tests need from an allocator."""

    kind: AllocatorKind
    block_size: int

    @property
    def capacity_tokens(self) -> int: ...
    @property
    def free_tokens(self) -> int: ...
    @property
    def used_tokens(self) -> int: ...
    @property
    def largest_free_block_tokens(self) -> int: ...
    @property
    def num_allocations(self) -> int: ...

    def charge(self, tokens: int) -> int:
        """Tokens a request of ``tokens`` actually occupies (rounded up to whole blocks)."""
        ...

    def fits(self, tokens: int) -> bool: ...
    def allocate(self, request_id: object, tokens: int) -> int | None: ...
    def free(self, request_id: object) -> int: ...
    def reset(self) -> None: ...
    def gaps(self) -> list[tuple[int, int]]: ...
    def __contains__(self, request_id: object) -> bool: ...


def _check_tokens(tokens: int) -> None:
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")


class ContiguousAllocator:
    """First-fit over one address range ``[0, capacity)``; freed neighbours coalesce.

    Free space is kept as two parallel sorted lists (gap starts, gap lengths) plus a
    sorted multiset of gap lengths, so the largest free block is O(1) to read and a
    request bigger than it is rejected without scanning. First-fit itself scans gaps in
    address order: O(#gaps), which stays in the hundreds for realistic workloads.
    """

    kind: AllocatorKind = "contiguous"
    block_size: int = 1

    __slots__ = ("_cap", "_free", "_lens", "_live", "_sizes", "_starts")

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        self._cap = int(capacity_tokens)
        self._starts: list[int] = []
        self._lens: list[int] = []
        self._sizes: list[int] = []  # sorted lengths of all gaps (a multiset)
        self._live: dict[object, tuple[int, int]] = {}
        self._free = 0
        self.reset()

    # --- figures -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self._cap

    @property
    def free_tokens(self) -> int:
        return self._free

    @property
    def used_tokens(self) -> int:
        return self._cap - self._free

    @property
    def largest_free_block_tokens(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    @property
    def num_gaps(self) -> int:
        return len(self._starts)

    def gaps(self) -> list[tuple[int, int]]:
        """Free gaps as ``(offset, length)`` in address order."""
        return list(zip(self._starts, self._lens, strict=True))

    def allocations(self) -> dict[object, tuple[int, int]]:
        """Live allocations as ``request_id -> (offset, length)`` (a copy)."""
        return dict(self._live)

    def charge(self, tokens: int) -> int:
        return tokens

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.largest_free_block_tokens

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    # --- operations ----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every allocation: one free gap spanning everything (what a restart does)."""
        self._starts = [0]
        self._lens = [self._cap]
        self._sizes = [self._cap]
        self._live = {}
        self._free = self._cap

    def allocate(self, request_id: object, tokens: int) -> int | None:
        """Place ``tokens`` in the lowest-addressed gap that holds them; ``None`` if none does."""
        _check_tokens(tokens)
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} already holds an allocation")
        if not self._sizes or tokens > self._sizes[-1]:
            return None
        lens = self._lens
        i = 0
        for i, length in enumerate(lens):  # noqa: B007 - i is used after the loop
            if length >= tokens:
                break
        offset = self._starts[i]
        length = lens[i]
        self._remove_size(length)
        if length == tokens:
            del self._starts[i]
            del lens[i]
        else:
            self._starts[i] = offset + tokens
            lens[i] = length - tokens
            insort(self._sizes, length - tokens)
        self._live[request_id] = (offset, tokens)
        self._free -= tokens
        return offset

    def free(self, request_id: object) -> int:
        """Release a request's region, merging it with free neighbours; returns tokens freed (0 if unknown)."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return 0
        offset, length = entry
        starts, lens = self._starts, self._lens
        i = bisect_left(starts, offset)  # index of the first gap after the region
        start, end = offset, offset + length
        merge_prev = i > 0 and starts[i - 1] + lens[i - 1] == start
        merge_next = i < len(starts) and starts[i] == end
        if merge_prev and merge_next:
            self._remove_size(lens[i - 1])
            self._remove_size(lens[i])
            new_len = lens[i - 1] + length + lens[i]
            lens[i - 1] = new_len
            del starts[i]
            del lens[i]
        elif merge_prev:
            self._remove_size(lens[i - 1])
            new_len = lens[i - 1] + length
            lens[i - 1] = new_len
        elif merge_next:
            self._remove_size(lens[i])
            new_len = length + lens[i]
            starts[i] = start
            lens[i] = new_len
        else:
            new_len = length
            starts.insert(i, start)
            lens.insert(i, length)
        insort(self._sizes, new_len)
        self._free += length
        return length

    def _remove_size(self, length: int) -> None:
        sizes = self._sizes
        del sizes[bisect_left(sizes, length)]

    def __repr__(self) -> str:
        return (
            f"ContiguousAllocator(capacity={self._cap}, free={self._free}, "
            f"largest={self.largest_free_block_tokens}, gaps={len(self._starts)}, live={len(self._live)})"
        )


class PagedAllocator:
    """Fixed-size blocks from a pool, any block anywhere (PagedAttention-style).

    A request needs ``ceil(tokens / block_size)`` blocks and fails only when fewer blocks
    than that are free, so every free block is usable: ``largest_free_block_tokens`` is all
    free blocks. What remains is internal waste (the unused tail of each request's last
    block), which shows up in ``used_tokens`` and in ``charge``.
    """

    kind: AllocatorKind = "paged"

    __slots__ = ("_free_blocks", "_live", "_nblocks", "block_size")

    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(
                f"capacity_tokens ({capacity_tokens}) must hold at least one block of {block_size}"
            )
        self.block_size = int(block_size)
        self._nblocks = int(capacity_tokens) // self.block_size
        self._free_blocks: list[int] = []
        self._live: dict[object, list[int]] = {}
        self.reset()

    @property
    def num_blocks(self) -> int:
        return self._nblocks

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self._nblocks * self.block_size

    @property
    def free_tokens(self) -> int:
        return len(self._free_blocks) * self.block_size

    @property
    def used_tokens(self) -> int:
        return self.capacity_tokens - self.free_tokens

    @property
    def largest_free_block_tokens(self) -> int:
        return self.free_tokens

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def charge(self, tokens: int) -> int:
        return self.blocks_needed(tokens) * self.block_size

    def fits(self, tokens: int) -> bool:
        return 0 < tokens and self.blocks_needed(tokens) <= len(self._free_blocks)

    def blocks_of(self, request_id: object) -> list[int]:
        return list(self._live.get(request_id, ()))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def reset(self) -> None:
        # A stack popped from the end: block 0 is handed out first, like a fresh pool.
        self._free_blocks = list(range(self._nblocks - 1, -1, -1))
        self._live = {}

    def allocate(self, request_id: object, tokens: int) -> int | None:
        """Take ``ceil(tokens/block_size)`` blocks; returns the token offset of the first one."""
        _check_tokens(tokens)
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} already holds an allocation")
        n = self.blocks_needed(tokens)
        pool = self._free_blocks
        if n > len(pool):
            return None
        taken = pool[-n:]
        del pool[-n:]
        taken.reverse()
        self._live[request_id] = taken
        return taken[0] * self.block_size

    def free(self, request_id: object) -> int:
        blocks = self._live.pop(request_id, None)
        if blocks is None:
            return 0
        blocks.reverse()
        self._free_blocks.extend(blocks)
        return len(blocks) * self.block_size

    def gaps(self) -> list[tuple[int, int]]:
        """Runs of adjacent free blocks as ``(offset, length)`` in tokens (diagnostic only)."""
        out: list[tuple[int, int]] = []
        bs = self.block_size
        for b in sorted(self._free_blocks):
            if out and out[-1][0] + out[-1][1] == b * bs:
                out[-1] = (out[-1][0], out[-1][1] + bs)
            else:
                out.append((b * bs, bs))
        return out

    def __repr__(self) -> str:
        return (
            f"PagedAllocator(blocks={self._nblocks}x{self.block_size}, free_blocks={len(self._free_blocks)}, "
            f"live={len(self._live)})"
        )


def make_allocator(
    kind: str, capacity_tokens: int, block_size: int = 16
) -> ContiguousAllocator | PagedAllocator:
    """Build an allocator by name; ``block_size`` only matters for ``paged``."""
    if kind == "contiguous":
        return ContiguousAllocator(capacity_tokens)
    if kind == "paged":
        return PagedAllocator(capacity_tokens, block_size)
    raise ValueError(f"unknown allocator kind {kind!r} (expected 'contiguous' or 'paged')")


def fragmentation(alloc: Allocator) -> float:
    """1 - largest free block / total free: 0 when free space is one block, towards 1 when checkerboarded."""
    free = alloc.free_tokens
    if free <= 0:
        return 0.0
    return 1.0 - min(1.0, alloc.largest_free_block_tokens / free)
