"""``memory_pressure``: forward projection, holds and fairness on paged engines (docs/memory-pressure.md)."""

from __future__ import annotations

from pydantic import Field

from proxy.config.base import _Strict


class MemoryPressureConfig(_Strict):
    """How the gateway keeps lazily allocating engines (vLLM, SGLang) from preempting."""

    enabled: bool = Field(
        default=True,
        description="false: every in-flight request counts at prompt + max_tokens until it ends",
    )
    output_quantile: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="expected output = this quantile of learned output/max_tokens times max_tokens",
    )
    min_samples: int = Field(
        default=20,
        ge=1,
        description="finished requests per model (or client) and request class before learning",
    )
    window: int = Field(default=500, ge=1, description="ratios kept per model (or client)")
    per_client: bool = Field(
        default=True,
        description="learn per client key (a hash of the Authorization header) before per model",
    )
    max_hold_s: float = Field(
        default=60.0,
        ge=0.0,
        description="a hold for a lazily allocating backend lasts at most this (then it joins "
        "that backend's queue); queue.max_wait_s when larger",
    )
    max_overtakes: int = Field(
        default=8,
        ge=0,
        description="a held request is overtaken at most this many times; then the node it "
        "is nearest to fitting on is kept for it (what ends before that room frees still goes)",
    )
    preemption_step: float = Field(
        default=0.05,
        gt=0.0,
        lt=1.0,
        description="capacity fraction taken off a node's budget per report with new preemptions",
    )
    preemption_floor: float = Field(
        default=0.6, gt=0.0, le=1.0, description="the lowest budget a node's preemptions set"
    )
    preemption_relax_s: float = Field(
        default=30.0, gt=0.0, description="seconds without preemptions that give one step back"
    )
