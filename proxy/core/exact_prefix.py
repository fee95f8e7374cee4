"""What each engine holds in its prefix cache, exactly, from its own KV-cache events.

The approximate index (``proxy.core.prefix``) records what this gateway sent and guesses
evictions by age and pressure. Engines that publish KV-cache events (vLLM) say what they
store and evict, including what other clients put there and what a restart wiped. This
index takes those events (``proxy.core.kv_events``) for one engine (one data-parallel rank)
and answers the same question as the approximate one: how many leading blocks of a request,
hashed by kvroute (``proxy.core.prefix.block_hashes``), the engine holds.

* Keys: the engine's block hash -> the kvroute hashes of the blocks ending inside it, plus
  the running chain state (``proxy.core.prefix_chain``) a child block continues from. The
  engine's own hash is needed because ``BlockRemoved`` and a child's ``parent_block_hash``
  name blocks by it; kvroute's because requests are hashed by it (per model tokenizer).
* A stored block whose parent is unknown here (stored before this index started, or in a
  message lost beyond replay) cannot be chained: it is counted (``orphans``) and skipped.
* Tiers: a block on the GPU saves its whole prefill; one in an offload tier (``medium``
  "CPU", a disk connector) must be loaded first. ``match`` returns both leading runs and the
  caller weighs the offloaded part lower.
* Only the base model's blocks of the first KV-cache group count: a LoRA adapter's blocks
  hold other values for the same tokens, and hybrid models repeat events per group.
* Memory is bounded: past ``max_blocks`` engine blocks the oldest stored go first (an
  engine that never sent its removals cannot grow the gateway without end).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    Event,
)
from proxy.core.prefix_chain import ROOT, ChainState, extend_blocks

#: Offload tiers told apart (GPU aside): CPU, disk, a remote store; more are ignored.
MAX_TIERS = 4


#: One engine block: the kvroute hashes ending in it, and the chain state at its end. A plain
#: tuple: a 2,000-block store builds 2,000 of them on the event loop (a frozen dataclass
#: costs ~3x more to build).
_Held = tuple[tuple[int, ...], ChainState]


@dataclass(frozen=True, slots=True)
class Match:
    """Leading blocks of a request the engine holds: on the GPU, and in any tier."""

    gpu_blocks: int = 0
    any_blocks: int = 0


class EngineIndex:
    """One engine's (one data-parallel rank's) cached blocks, keyed both ways."""

    def __init__(self, block_tokens: int, max_blocks: int = 500_000) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._held: OrderedDict[tuple[str, BlockKey], _Held] = OrderedDict()
        self._gpu: dict[int, int] = {}
        self._offloaded: dict[int, int] = {}
        self._mediums: set[str] = set()
        self.orphans = 0
        self.ignored = 0

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            for key in event.block_hashes:
                self._drop((event.medium, key))
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        self._held.clear()
        self._gpu.clear()
        self._offloaded.clear()

    def match(self, hashes: Sequence[int]) -> Match:
        gpu_lead = -1
        run = 0
        for h in hashes:
            on_gpu = h in self._gpu
            if not on_gpu and h not in self._offloaded:
                break
            if not on_gpu and gpu_lead < 0:
                gpu_lead = run
            run += 1
        return Match(run if gpu_lead < 0 else gpu_lead, run)

    def blocks(self) -> int:
        """Engine blocks held (what ``max_blocks`` bounds)."""
        return len(self._held)

    def hashes(self) -> int:
        """Distinct kvroute blocks held, all tiers."""
        return len(self._gpu.keys() | self._offloaded.keys())

    def _stored(self, ev: BlockStored) -> None:
        if ev.lora or ev.group != 0 or not self._known_medium(ev.medium):
            self.ignored += len(ev.block_hashes)
            return
        start = ROOT if ev.parent is None else self._parent_state(ev.medium, ev.parent)
        if start is None:
            self.orphans += len(ev.block_hashes)
            return
        chained = extend_blocks(start, ev.token_ids, ev.block_size, self.block_tokens)
        medium, held = ev.medium, self._held
        tier = self._gpu if medium == MEDIUM_GPU else self._offloaded
        for key, entry in zip(ev.block_hashes, chained, strict=True):
            slot = (medium, key)
            if slot in held:
                self._drop(slot)
            held[slot] = entry
            for h in entry[0]:
                tier[h] = tier.get(h, 0) + 1
        while len(self._held) > self.max_blocks:
            self._drop(next(iter(self._held)))

    def _known_medium(self, medium: str) -> bool:
        """Tiers seen so far, a few at most (a hostile stream cannot make lookups slow)."""
        if medium == MEDIUM_GPU or medium in self._mediums:
            return True
        if len(self._mediums) >= MAX_TIERS:
            return False
        self._mediums.add(medium)
        return True

    def _parent_state(self, medium: str, parent: BlockKey) -> ChainState | None:
        # The parent may live in another tier: same chain, any tier will do.
        for m in (medium, MEDIUM_GPU, *self._mediums):
            held = self._held.get((m, parent))
            if held is not None:
                return held[1]
        return None

    def _drop(self, slot: tuple[str, BlockKey]) -> None:
        held = self._held.pop(slot, None)
        if held is None:
            return
        tier = self._gpu if slot[0] == MEDIUM_GPU else self._offloaded
        for h in held[0]:
            n = tier.get(h, 0) - 1
            if n > 0:
                tier[h] = n
            else:
                tier.pop(h, None)


def cached_tokens(match: Match, block_tokens: int, offloaded_weight: float) -> int:
    """The expected prefill saving: GPU blocks in full, offloaded ones weighed lower."""
    offloaded = match.any_blocks - match.gpu_blocks
    return int(match.gpu_blocks * block_tokens + offloaded * block_tokens * offloaded_weight)
