"""Disaggregated prefill and decode (docs/disaggregation.md): when a request takes two steps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.base import _Strict


class DisaggregationConfig(_Strict):
    """Two-step requests, on a fleet where some backend has ``role: prefill``.

    Without any prefill backend nothing here applies: every request is one step, as before.
    """

    protocol: Literal["nixl"] = Field(
        default="nixl",
        description="how the KV moves: vLLM's kv_transfer_params (NIXL and the connectors "
        "that share its proxy protocol)",
    )
    min_uncached_prompt_tokens: int = Field(
        default=512,
        ge=0,
        description="conditional disaggregation: a prompt with fewer tokens not already cached "
        "on a decode server goes straight to that server as one ordinary request",
    )
    early_prefill_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="a request held for a decode server prefills meanwhile while the prompt "
        "tokens a prefill server holds for held requests stay within this fraction of its KV; "
        "0: never prefill during the hold",
    )
    decode_order: Literal["spread", "best_fit"] = Field(
        default="spread",
        description="long requests' decode step among the decode servers that fit: spread "
        "(the order of one-step requests: queue, then load) or best_fit (the least room that "
        "holds its projected peak: the largest room stays whole for the next long document; "
        "measured: no steady TTFT gain, decode servers less balanced)",
    )
