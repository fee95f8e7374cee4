"""A second paged engine model, written from vLLM v1's scheduler (``--scheduler v1``).

kvroute's rules for paged engines were tuned on ``scheduler.PagedCore`` (the "classic"
model: decode steps of fixed length, prefill at a fixed rate beside them), and lost to a
blind ``power_of_two`` on an engine built another way (issue 53). This model follows the
facts of vLLM v1's ``vllm/v1/core/sched/scheduler.py`` instead, so a rule that only holds on
one model shows up:

* every step has a token budget (``max_num_batched_tokens``); RUNNING requests are served
  first, in admission order: a decode takes 1 token, a request still prefilling takes a
  chunk of what is left of its prompt, up to the budget left (chunked prefill);
* WAITING requests are admitted FIFO after them, while budget, ``max_num_seqs`` and free
  blocks allow, and not at all in a step that preempted (as vLLM does); the head that does
  not fit blocks everyone behind it;
* KV blocks are taken lazily, for the tokens scheduled in the step: a prompt's blocks as
  its chunks are prefilled, one more block when a decode crosses a block boundary;
* when a running request needs a block and none is free, the NEWEST running request is
  preempted (its blocks freed, back to the head of WAITING, recomputed from scratch later),
  counted in ``vllm:num_preemptions_total``; if that is the request itself, it waits;
* a step lasts ``step_base_s + step_per_token_s * scheduled_tokens``: a big prefill chunk
  slows every decode in its batch, which the classic model never does;
* a token is sampled at the end of a step for every request whose computed tokens caught
  up with its tokens (end of prefill, or a decode);
* disaggregated serving (``disaggregation.py``): a prefill server's request is scheduled as
  any other (chunks, budget) and only keeps its blocks after it ends. A decode server's
  request with pulled KV is admitted FIFO with blocks for its whole prompt, as vLLM's NIXL
  connector allocates them, then takes no budget until the transfer ends (prompt tokens
  at ``transfer_tokens_per_s``); vLLM then recomputes the prompt's last token for its
  logits: one token in the next step, which samples the first token. It never prefills the
  prompt itself, unless it is preempted: then it recomputes everything, as vLLM does.

No prefix caching here (every prompt is computed): the benchmarks that use this model send
distinct prompts. The HTTP front, the metrics and the streams are shared with the classic
model: this class keeps ``PagedCore``'s interface (``submit``, ``abort``, ``step``,
``free_held``, ``state`` and the figures the dialects read), only the scheduling differs.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from loadtest.engine.behaviours.scheduler import LONG_PROMPT, PagedCore, SimRequest

#: Below this a step's end is not slept for: it is run at once, up to this early (the loop
#: would otherwise wake every step, a millisecond apart at ``--speedup 10``).
TICK_S = 0.002


@dataclass
class StepPlan:
    """One step's batch: each scheduled request with its tokens, and their sum."""

    start: float
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    preempted: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _req, n in self.scheduled)


class V1Core(PagedCore):
    """One engine stepped as vLLM v1's scheduler steps it: budget, chunks, newest preempted."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_base_s: float,
        step_per_token_s: float,
    ) -> None:
        # ``prefill_tokens_per_s`` only names the rate a full-budget step reaches.
        rate = 1.0 / step_per_token_s if step_per_token_s > 0 else float("inf")
        super().__init__(num_blocks, block_size, max_num_seqs, step_base_s, rate)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_base_s = step_base_s
        self.step_per_token_s = step_per_token_s
        self.steps = 0

    # --- the interface the front uses --------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request; the next step's scheduling looks at it (never admitted here)."""
        self.waiting.append(req)
        self._wake.set()

    def _admit(self, now: float) -> None:
        # ``free_held`` frees blocks and asks for admission: the next step does it.
        self._wake.set()

    def step(self, now: float, steps: int = 1) -> None:
        """Run ``steps`` whole steps back to back from ``now`` (tests, ``/wake_up``)."""
        clock = now
        for _ in range(steps):
            plan = self.schedule(clock)
            if not plan.scheduled:
                break
            clock += self.step_time(plan)
            self.finish(plan, clock)
        self._wake.set()

    def step_time(self, plan: StepPlan) -> float:
        return self.step_base_s + self.step_per_token_s * plan.tokens

    def state(self) -> dict[str, int | bool]:
        """The classic model's ground truth, and the steps run (a pulled prompt takes none)."""
        return {**super().state(), "steps": self.steps}

    # --- scheduling ------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """Choose the step's batch at ``now``: running first, then waiting; take the blocks."""
        plan = StepPlan(now)
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if plan.preempted == 0:
            self._schedule_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._transferring(req, plan.start):
                i += 1
                continue
            n = min(req.tokens - req.kv_computed, budget)
            if not self._allocate(req, n, plan):
                # vLLM stops serving running requests at the first that cannot get a block.
                break
            plan.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _allocate(self, req: SimRequest, n: int, plan: StepPlan) -> bool:
        """Blocks for ``req``'s next ``n`` tokens, preempting the newest running requests."""
        need = self._blocks_for(req.kv_computed + n) - req.blocks
        while need > self.free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            victim.kv_computed = 0
            plan.preempted += 1
            if victim is req:
                return False
        if need > 0:
            self._take(need)
            req.blocks += need
        return True

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if head.arrived_at > now:
                return  # arrived after this step began (the loop runs a little late)
            if _pulled(head):
                if not self._admit_pulled(head, now):
                    return
                continue
            n = min(head.tokens - head.kv_computed, budget)
            need = self._blocks_for(head.kv_computed + n) - head.blocks
            if need > self.free_blocks:
                return  # FIFO: the head waits, and everything behind it
            self.waiting.popleft()
            self._take(need)
            head.blocks += need
            self._note_admission(head, now)
            self.running.append(head)
            plan.scheduled.append((head, n))
            budget -= n

    def _admit_pulled(self, head: SimRequest, now: float) -> bool:
        """A decode server's request with pulled KV: blocks for its whole prompt now (FIFO, the
        head that does not fit waits), no budget until the transfer ends at ``decode_at``."""
        need = self._blocks_for(head.tokens) - head.blocks
        if need > self.free_blocks:
            return False
        self.waiting.popleft()
        self._take(need)
        head.blocks += need
        self._note_admission(head, now)
        assert head.transfer_tokens_per_s is not None
        head.decode_at = now + head.tokens / head.transfer_tokens_per_s
        # vLLM recomputes the last prompt token (its logits sample the first output token).
        head.kv_computed = head.tokens - 1
        self.running.append(head)
        return True

    def _transferring(self, req: SimRequest, now: float) -> bool:
        return _pulled(req) and now < req.decode_at

    def _note_admission(self, req: SimRequest, now: float) -> None:
        """The figures the classic model keeps at admission, kept the same way here."""
        if req.scheduled_at is None:
            req.scheduled_at = now
            req.computed = req.prompt_tokens
        if req.prompt_tokens >= LONG_PROMPT and not req.preempted:
            self.stats.long_waits += 1
            self.stats.long_wait_s += now - req.arrived_at
        # Prompt plus what a preempted request had generated: all of it is computed again.
        self.stats.prompt_tokens += req.tokens

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- the step's end --------------------------------------------------------------------

    def finish(self, plan: StepPlan, end: float) -> None:
        """The step ran until ``end``: add the computed tokens, sample one where caught up."""
        self.steps += 1
        for req, n in plan.scheduled:
            if req.done:
                continue  # aborted while the step ran
            req.kv_computed += n
            if req.kv_computed >= req.tokens:
                self._sample(req, end)

    # --- the step loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:
            plan = None if self.sleeping else self.schedule(clock)
            if plan is None or not plan.scheduled:
                await self._idle(clock)
                clock = max(clock, loop.time())
                continue
            end = clock + self.step_time(plan)
            ahead = end - loop.time()
            # Sleep until the step's end; a step ending within a tick is run at once, but the
            # loop still yields so that streams and new requests are served between steps.
            await asyncio.sleep(ahead if ahead > TICK_S else 0)
            self.finish(plan, end)
            clock = end

    async def _idle(self, clock: float) -> None:
        """Nothing can run (idle, asleep, a head that arrived after ``clock``, or transfers
        under way): wait for a request, a wake-up, or the first transfer's end."""
        self._wake.clear()
        if self.sleeping:
            await self._wake.wait()
            return
        if self.waiting:
            await asyncio.sleep(TICK_S)
            return
        ends = [r.decode_at for r in self.running if self._transferring(r, clock)]
        if not ends:
            await self._wake.wait()
            return
        pause = max(TICK_S, min(ends) - asyncio.get_running_loop().time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), pause)


def _pulled(req: SimRequest) -> bool:
    """Its prompt's KV comes from a prefill server (until a preemption makes it recompute)."""
    return req.transfer_tokens_per_s is not None and not req.preempted
