"""Which scheduler model a simulated server's engines run: ``--scheduler classic|v1``.

Both models share ``PagedCore``'s interface, so the front, the dialects' metrics and the
streams never know which one they drive; this is the one place that picks.
"""

from __future__ import annotations

from typing import Protocol

from loadtest.engine.behaviours.scheduler import PagedCore
from loadtest.engine.behaviours.v1_scheduler import V1Core

SCHEDULERS = ("classic", "v1")


class CoreConfig(Protocol):
    """What a core is made from: ``app.BehaviourConfig``'s fields (app.py imports this module,
    so the type is named by its fields here, not imported: no import circle)."""

    @property
    def behaviour(self) -> str: ...
    @property
    def scheduler(self) -> str: ...
    @property
    def capacity_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def decode_tokens_per_s(self) -> float: ...
    @property
    def speedup(self) -> float: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def serial_prefill(self) -> bool: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def step_base_ms(self) -> float: ...
    @property
    def step_per_token_us(self) -> float | None: ...


def make_core(config: CoreConfig) -> PagedCore:
    """One engine core as ``config`` describes it; simulated times divided by ``speedup``."""
    num_blocks = config.capacity_tokens // config.block_size
    if config.scheduler == "v1":
        per_token_us = config.step_per_token_us
        if per_token_us is None:
            # A full-budget prefill step then runs at about ``prefill_tokens_per_s``.
            per_token_us = 1e6 / config.prefill_tokens_per_s
        return V1Core(
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.step_base_ms / 1e3 / config.speedup,
            per_token_us / 1e6 / config.speedup,
        )
    return PagedCore(
        num_blocks,
        config.block_size,
        config.max_num_seqs,
        1.0 / (config.decode_tokens_per_s * config.speedup),
        config.prefill_tokens_per_s * config.speedup,
        reserve_full=config.behaviour == "tgi",
        prefix_caching=config.behaviour == "vllm" and config.prefix_caching,
        serial_prefill=config.serial_prefill,
    )
