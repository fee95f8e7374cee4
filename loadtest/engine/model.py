"""The simulated engine's model: its allocator, counters, simulated time, faults and restarts.

No HTTP here (``loadtest.engine.handlers`` answers requests over this state, the command
line is ``loadtest.engine.cli``): what an engine *is* apart from how it is asked. Each
request reserves ``prompt + max_tokens`` tokens in a contiguous first-fit or a paged
allocator for its whole life and gives them back when it ends, fails, or its client goes
away; a request that cannot be placed fails at once. Time is simulated: prefill and decode
take ``tokens / rate / speedup`` seconds, and ``restart`` interrupts every sleep in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

from loadtest.engine.allocators import ContiguousAllocator, PagedAllocator, make_allocator
from loadtest.engine.protocol import Parsed, error_body, generated_text

FAULT_MODES = ("none", "hang", "garbage", "error500")
FAULT_SCOPES = ("inference", "all")
RESTARTED_TYPE = "engine_restarted"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine process is started with (the CLI flags, one for one)."""

    name: str = "engine"
    host: str = "127.0.0.1"
    port: int = 8101
    model: str = "sim-model"
    allocator: str = "contiguous"
    capacity_tokens: int = 100_000
    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    speedup: float = 1.0
    default_max_tokens: int = 256
    seed: int = 0
    chunk_interval_s: float = 0.02
    strict_model: bool = False
    uvloop: bool = True

    def __post_init__(self) -> None:
        if self.allocator not in ("contiguous", "paged"):
            raise ValueError(f"allocator must be 'contiguous' or 'paged', got {self.allocator!r}")
        positive = {
            "capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "speedup": self.speedup,
            "default_max_tokens": self.default_max_tokens,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"{key} must be positive, got {value}")
        if self.chunk_interval_s < 0:
            raise ValueError(f"chunk_interval_s must be >= 0, got {self.chunk_interval_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {self.port}")


class EngineRestarted(Exception):
    """Raised inside an in-flight request when /admin/restart empties the allocator under it."""


@dataclass(slots=True, eq=False)
class LiveRequest:
    request_no: int
    waiter: asyncio.Future[None] | None = None
    restarted: bool = False


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


OUTCOMES = (
    "ok",
    "allocation_failed",
    "context_length_exceeded",
    "bad_request",
    "cancelled",
    "restarted",
)


class EngineModel:
    """The engine's state (one per aiohttp app); ``Engine`` adds the HTTP handlers."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.allocator: ContiguousAllocator | PagedAllocator = make_allocator(
            config.allocator, config.capacity_tokens, config.block_size
        )
        self.started_at = time.time()
        self.restarts = 0
        self.running = 0
        self.waiting = 0
        self.allocation_failures = 0  # since the last (re)start, like a process's counter
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # since the last (re)start
        self.lifetime_allocation_failures = 0
        self.lifetime_requests = 0
        self.fault = "none"
        self.fault_scope = "inference"
        self._hang_release = asyncio.Event()
        self._live: dict[int, LiveRequest] = {}
        self._held: set[str] = set()
        self._next = 0
        self._id_prefix = secrets.token_hex(4)
        self._rng = random.Random(config.seed)
        per_token = 1.0 / (config.decode_tokens_per_s * config.speedup)
        self._per_token_s = per_token
        self._tokens_per_chunk = (
            max(1, math.ceil(config.chunk_interval_s / per_token)) if per_token > 0 else 1
        )
        self._headers = {"x-engine-name": config.name}

    def figures(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "name": self.config.name,
            "model": self.config.model,
            "allocator": a.kind,
            "block_size": a.block_size,
            "capacity_tokens": a.capacity_tokens,
            "free_tokens": a.free_tokens,
            "used_tokens": a.used_tokens,
            "largest_free_block_tokens": a.largest_free_block_tokens,
            "gaps": len(a.gaps()) if isinstance(a, PagedAllocator) else a.num_gaps,
            "allocations": a.num_allocations,
            "held": len(self._held),
            "running": self.running,
            "waiting": self.waiting,
            "allocation_failures": self.allocation_failures,
            "outcomes": dict(self.outcomes),
            "lifetime_allocation_failures": self.lifetime_allocation_failures,
            "lifetime_requests": self.lifetime_requests,
            "started_at": self.started_at,
            "uptime_s": max(0.0, time.time() - self.started_at),
            "restarts": self.restarts,
            "fault": self.fault,
            "fault_scope": self.fault_scope,
            "speedup": self.config.speedup,
        }

    # --- simulated time -----------------------------------------------------------------
    async def _sleep(self, live: LiveRequest, delay: float) -> None:
        """asyncio.sleep that /admin/restart can interrupt (raises EngineRestarted)."""
        if live.restarted:
            raise EngineRestarted
        if delay <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(delay, _wake, fut)
        live.waiter = fut
        try:
            await fut
        finally:
            handle.cancel()
            live.waiter = None

    # --- admin actions ------------------------------------------------------------------
    def restart(self) -> int:
        """What a process restart does: in-flight requests fail, memory empties, uptime resets."""
        n = 0
        for live in self._live.values():
            live.restarted = True
            if live.waiter is not None and not live.waiter.done():
                live.waiter.set_exception(EngineRestarted())
            n += 1
        self._live.clear()
        self.allocator.reset()
        self._held.clear()
        self.running = 0
        self.allocation_failures = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.started_at = time.time()
        self.restarts += 1
        self._release_hung()
        return n

    def _release_hung(self) -> None:
        self._hang_release.set()
        self._hang_release = asyncio.Event()

    def set_fault(self, mode: str, scope: str = "inference") -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        if scope not in FAULT_SCOPES:
            raise ValueError(f"scope must be one of {FAULT_SCOPES}, got {scope!r}")
        if self.fault == "hang" and mode != "hang":
            self._release_hung()
        self.fault = mode
        self.fault_scope = scope

    def _prefill_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / (self.config.prefill_tokens_per_s * self.config.speedup)

    def _completion_id(self, p: Parsed, request_no: int) -> str:
        return f"{'chatcmpl' if p.chat else 'cmpl'}-{self._id_prefix}-{request_no}"

    def _text(self, request_no: int, pos: int, n: int) -> str:
        return generated_text(request_no * 7919 + self.config.seed + pos, n)

    def _restarted_body(self) -> bytes:
        return error_body(
            "the engine restarted while the request was in flight",
            RESTARTED_TYPE,
            None,
            RESTARTED_TYPE,
        )

    # --- admission and memory -------------------------------------------------------------
    def context_refusal(self, prompt_tokens: int, max_tokens: int, chat: bool) -> bytes | None:
        """The 400 body for a request larger than the whole cache (counted), or None."""
        demand = prompt_tokens + max_tokens
        alloc = self.allocator
        if alloc.charge(demand) <= alloc.capacity_tokens:
            return None
        self.outcomes["context_length_exceeded"] += 1
        what = "messages" if chat else "prompt"
        msg = (
            f"This model's maximum context length is {alloc.capacity_tokens} tokens. However, you "
            f"requested {demand} tokens ({prompt_tokens} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or completion."
        )
        return error_body(msg, "invalid_request_error", what, "context_length_exceeded")

    def admit(self, demand: int) -> LiveRequest | None:
        """Reserve ``demand`` tokens for a new request; None (counted) when it cannot be placed."""
        self._next += 1
        request_no = self._next
        if self.allocator.allocate(request_no, demand) is None:
            self.allocation_failures += 1
            self.lifetime_allocation_failures += 1
            self.outcomes["allocation_failed"] += 1
            return None
        live = LiveRequest(request_no)
        self._live[request_no] = live
        self.running += 1
        return live

    def finish(self, live: LiveRequest, outcome: str) -> None:
        """A request ended: its memory back (unless a restart already emptied it), counted."""
        if not live.restarted:  # after a restart the allocator and counters are already fresh
            self._live.pop(live.request_no, None)
            self.allocator.free(live.request_no)
            self.running -= 1
        self.outcomes[outcome] += 1

    def hold(self, tokens: int, count: int) -> tuple[list[dict[str, Any]], int]:
        """Pin ``count`` regions of ``tokens`` outside any request: those held, and failures."""
        held: list[dict[str, Any]] = []
        failed = 0
        for _ in range(count):
            self._next += 1
            hid = f"hold-{self._next}"
            offset = self.allocator.allocate(hid, tokens)
            if offset is None:
                failed += 1
                continue
            self._held.add(hid)
            held.append({"id": hid, "offset": offset, "tokens": tokens})
        return held, failed

    def release(self, ids: list[str] | None) -> int:
        """Free held regions (``None``: all of them); how many were released."""
        released = 0
        for hid in list(self._held) if ids is None else ids:
            if hid in self._held:
                self._held.discard(hid)
                self.allocator.free(hid)
                released += 1
        return released

    def _memory(self) -> dict[str, int]:
        a = self.allocator
        return {
            "free_tokens": a.free_tokens,
            "largest_free_block_tokens": a.largest_free_block_tokens,
            "capacity_tokens": a.capacity_tokens,
        }
