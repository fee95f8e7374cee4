"""One simulated paged engine core that allocates lazily, queues and preempts, as vLLM does.

Time is simulated: every ``step_s`` each running request past its prefill produces one token.
KV is paged in blocks of ``block_size`` tokens:

* admission (FIFO, head of line first, at most ``max_num_seqs`` running) takes the blocks
  for the tokens to prefill only: prompt plus anything generated before a preemption;
* each decode step that crosses a block boundary takes one more block; when none is free,
  the most recently admitted running request is preempted: its blocks are freed, it goes
  back to the head of the queue and later recomputes its prompt and what it had generated;
* ``reserve_full`` (TGI) instead takes prompt + max_tokens at admission, so nothing grows
  and nothing is preempted;
* freed blocks keep their content as prefix cache but are free (reclaimed on demand), so
  they never count as used; with ``prefix_caching`` (vLLM) a request's leading prompt
  blocks found in that cache (``prefix_cache.PrefixCache``) are shared or reused and skip
  prefill: only the blocks not found are allocated and computed;
* with ``serial_prefill`` prefill is one GPU's compute, as in vLLM's scheduler (one token
  budget per step, running prefills first): prompts are prefilled one after another at
  ``prefill_tokens_per_s``, so a request waits for the prefill admitted before it, and a
  prefix-cache hit shortens the wait of everyone behind it. Without it every admitted
  prompt prefills at full speed at once (no contention: the older, simpler model). The
  offline simulator (``loadtest.sim.prefix``) models prefill the serial way.

A request that can never fit one engine is refused before it gets here (``max_model_len``).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from loadtest.engine.behaviours.prefix_cache import PrefixCache

# Buckets of vLLM's time-to-first-token histogram (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


# Buckets of vLLM's request prompt-token histogram.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass
class Histogram:
    """A cumulative histogram as Prometheus exports it (bucket counts are cumulative)."""

    bounds: tuple[float, ...]
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.buckets[i] += 1

    def exported(self) -> list[tuple[str, float]]:
        """Buckets as prometheus_client's HistogramMetricFamily takes them, ``+Inf`` last."""
        out = [(repr(float(b)), float(n)) for b, n in zip(self.bounds, self.buckets, strict=True)]
        out.append(("+Inf", float(self.count)))
        return out


#: A prompt this long counts in the long-prompt wait figures (``CoreStats.long_wait_s``).
LONG_PROMPT = 8_000


@dataclass(eq=False)
class SimRequest:
    """One request's life in a core; the HTTP handler waits on ``changed``."""

    prompt_tokens: int
    max_tokens: int
    arrived_at: float
    generated: int = 0
    blocks: int = 0
    decode_at: float = math.inf  # when prefill ends and tokens start
    first_token_at: float | None = None
    scheduled_at: float | None = None  # first admitted to the running batch
    computed: int = 0  # prompt tokens prefilled at that admission (prefix-cache hits excluded)
    preempted: int = 0
    done: bool = False
    aborted: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The prompt's full-block hashes (prefix caching) and whether the core holds them now.
    hashes: tuple[int, ...] = ()
    holds_hashes: bool = False
    # Those blocks' token ids, for the KV-cache events a publishing engine sends.
    block_ids: tuple[int, ...] = ()
    # Disaggregated serving (``disaggregation.py``): a prefill's blocks kept after it ends for
    # a remote decode; a decode's prompt pulled at this rate instead of prefilled.
    keep_blocks: bool = False
    transfer_tokens_per_s: float | None = None
    # The v1 model (``v1_scheduler.py``): tokens whose KV is computed so far; prefill chunks
    # and decode steps add to it, a preemption resets it to 0.
    kv_computed: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass
class CoreStats:
    preemptions: int = 0
    prompt_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached
    generation_tokens: int = 0
    finished: int = 0
    # Long prompts (>= LONG_PROMPT tokens): time from arrival to the start of their prefill
    # (the FIFO queue for KV, then the prefill queue when serial), to tell placement apart.
    long_waits: int = 0
    long_wait_s: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    # vLLM V1's per-request histograms, observed when a request finishes (as vLLM does):
    # queue time (arrival to first scheduled), prefill time (first scheduled to first
    # token) and prompt tokens; the gateway learns the prefill rate from their sums.
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    request_prompt_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    computed_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))


class PagedCore:
    """One engine: its blocks, its FIFO queue, its running batch, its step loop."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        step_s: float,
        prefill_tokens_per_s: float,
        reserve_full: bool = False,
        prefix_caching: bool = False,
        serial_prefill: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.reserve_full = reserve_full
        self.free_blocks = num_blocks
        self.cached_blocks = 0  # free blocks still holding a finished request's prefix
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.sleeping = False
        self.stats = CoreStats()
        self.prefix = PrefixCache(block_size) if prefix_caching else None
        self.serial_prefill = serial_prefill
        # With serial prefill: when the prefill admitted last ends (loop time).
        self.prefill_free_at = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- figures ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Used fraction; a sleeping engine has offloaded or dropped its cache and reads 0."""
        return 0.0 if self.sleeping else self.used_blocks / self.num_blocks

    def load(self) -> int:
        """The front end's balancing score: queue length, not KV (waiting weighs more)."""
        return 4 * len(self.waiting) + len(self.running)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request; it is admitted at once when it fits (the next step is that close)."""
        self.waiting.append(req)
        if not self.sleeping:
            self._admit(now)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The client went away: free what it holds, wherever it is."""
        if req.done:
            return
        req.aborted = True
        req.done = True
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # --- the step loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        # Never spin faster than 2 ms a turn; a turn catches up on all the steps it covers.
        tick = max(self.step_s, 0.002)
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                last = loop.time()
            await asyncio.sleep(tick)
            now = loop.time()
            steps = max(1, int((now - last) / self.step_s))
            last += steps * self.step_s
            if not self.sleeping:
                self.step(now, steps)

    def step(self, now: float, steps: int = 1) -> None:
        """Advance ``steps`` decode steps at time ``now``, then admit what fits."""
        for _ in range(steps):
            self._decode_one(now)
        self._admit(now)

    def _decode_one(self, now: float) -> None:
        for req in list(self.running):
            if req not in self.running or now < req.decode_at:
                continue
            if not self._grow(req):
                continue
            self._sample(req, now)

    def _sample(self, req: SimRequest, now: float) -> None:
        """One token written: the first one's TTFT, the last one's end (both schedulers)."""
        req.generated += 1
        self.stats.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.ttft.observe(now - req.arrived_at)
        if req.generated >= req.max_tokens:
            req.done = True
            self.running.remove(req)
            if not req.keep_blocks:
                self._release(req)
            self._observe_finished(req)
        req.changed.set()

    def _grow(self, req: SimRequest) -> bool:
        """Room for one more token: a new block on a boundary, preempting when none is free."""
        held = req.blocks + (len(req.hashes) if req.holds_hashes else 0)
        if self.reserve_full or req.tokens + 1 <= held * self.block_size:
            return True
        while self.free_blocks == 0:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        self._take(1)
        req.blocks += 1
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.preempted += 1
        req.decode_at = math.inf
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            tokens = head.prompt_tokens + (head.max_tokens if self.reserve_full else head.generated)
            need = -(-tokens // self.block_size)
            hits, shared = self.prefix.lookup(head.hashes) if self.prefix is not None else (0, 0)
            if need - shared > self.free_blocks:
                return  # FIFO: the head waits, and everything behind it
            self.waiting.popleft()
            first_admission = head.scheduled_at is None
            if first_admission:
                head.scheduled_at = now
            head.blocks = need
            cached = min(hits * self.block_size, head.tokens - 1)
            if self.prefix is not None:
                # The prompt's full blocks are shared and counted by hash, the rest are its own
                # (taken before the allocator hands out free blocks, which evicts cached ones).
                self.prefix.acquire(head.hashes, head.block_ids)
                head.holds_hashes = True
                head.blocks = need - len(head.hashes)
                self.stats.prefix_queries += head.prompt_tokens
                self.stats.prefix_hits += max(0, cached)
            self._take(need - shared)
            # Recompute after a preemption: prompt and generated tokens are prefilled again
            # (less what the prefix cache still holds).
            pulled = head.transfer_tokens_per_s is not None and not head.preempted
            rate = head.transfer_tokens_per_s if pulled else None
            work = (head.tokens - max(0, cached)) / (rate or self.prefill_tokens_per_s)
            serial = self.serial_prefill and not pulled
            start = max(now, self.prefill_free_at) if serial else now
            head.decode_at = start + work
            if head.prompt_tokens >= LONG_PROMPT and not head.preempted:
                self.stats.long_waits += 1
                self.stats.long_wait_s += start - head.arrived_at
            if serial:
                self.prefill_free_at = head.decode_at
            self.stats.prompt_tokens += head.tokens
            if first_admission:
                head.computed = head.prompt_tokens - max(0, cached)
            self.running.append(head)

    def free_held(self, req: SimRequest, now: float) -> None:
        """Free a finished request's kept blocks (a prefill pulled or timed out), admit what fits."""
        self._release(req)
        if not self.sleeping:
            self._admit(now)
        self._wake.set()

    def _take(self, n: int) -> None:
        self.free_blocks -= n
        self.cached_blocks = min(self.cached_blocks, self.free_blocks)
        if self.prefix is not None:
            self.prefix.trim(self.free_blocks)

    def _release(self, req: SimRequest) -> None:
        freed = req.blocks
        if self.prefix is not None and req.holds_hashes:
            freed += self.prefix.release(req.hashes)
            req.holds_hashes = False
        self.free_blocks += freed
        self.cached_blocks += freed
        req.blocks = 0

    def _observe_finished(self, req: SimRequest) -> None:
        s = self.stats
        s.finished += 1
        scheduled = req.scheduled_at if req.scheduled_at is not None else req.arrived_at
        first = req.first_token_at if req.first_token_at is not None else scheduled
        s.queue_time.observe(scheduled - req.arrived_at)
        s.prefill_time.observe(first - scheduled)
        s.request_prompt_tokens.observe(req.prompt_tokens)
        s.computed_tokens.observe(req.computed)

    def state(self) -> dict[str, int | bool]:
        """The ground truth the tests compare /metrics against."""
        return {
            "capacity_tokens": self.capacity_tokens,
            "free_tokens": self.free_blocks * self.block_size,
            "used_tokens": self.used_blocks * self.block_size,
            "cached_free_tokens": self.cached_blocks * self.block_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.stats.preemptions,
            "finished": self.stats.finished,
            "sleeping": self.sleeping,
        }
