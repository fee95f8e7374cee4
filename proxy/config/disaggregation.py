"""Disaggregated prefill and decode (docs/disaggregation.md): when a request takes two steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from proxy.config.base import _Strict

if TYPE_CHECKING:
    from proxy.config.backends import BackendConfig


class DisaggregationConfig(_Strict):
    """Two-step requests, on a fleet where some backend has ``role: prefill``.

    Without any prefill backend nothing here applies: every request is one step, as before.
    """

    protocol: Literal["nixl", "sglang"] = Field(
        default="nixl",
        description="how the KV moves: nixl, vLLM's kv_transfer_params in two steps one after "
        "the other (NIXL and the connectors that share its proxy protocol); sglang, SGLang's "
        "bootstrap host, port and room sent to the prefill and the decode server at once",
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
    decode_order: Literal["spread", "best_fit"] | None = Field(
        default=None,
        description="long requests' decode step among the decode servers that fit: best_fit "
        "(the least room that holds its projected peak: the largest room stays whole for the "
        "next long document) or spread (the order of one-step requests: queue, then load); "
        "unset: best_fit with protocol nixl, spread with sglang (measured: best fit cost one "
        "decode preemption a run on SGLang's protocol, none on vLLM's)",
    )

    def order(self) -> Literal["spread", "best_fit"]:
        """``decode_order``, or the measured default for the protocol when it is unset."""
        if self.decode_order is not None:
            return self.decode_order
        return "spread" if self.protocol == "sglang" else "best_fit"


def check_sglang_fleet(backends: Sequence[BackendConfig]) -> None:
    """An SGLang fleet (``protocol: sglang``) as SGLang's servers need it; errors name the key.

    A server started with ``--disaggregation-mode prefill`` or ``decode`` answers 400 to a
    request without a bootstrap room, and one started without it takes no part in the
    transfer: every backend is a prefill or a decode server, and both kinds are present
    (checked only for a static list; discovery fills it later).
    """
    for i, b in enumerate(backends):
        if b.role == "both":
            raise ValueError(
                f"backends.{i}.role: 'both' is not possible with disaggregation.protocol: sglang "
                f"(backend {b.name!r}): an SGLang server runs in prefill or decode mode "
                "(--disaggregation-mode); set role: prefill or role: decode"
            )
        if b.role != "prefill" and "bootstrap_port" in b.model_fields_set:
            raise ValueError(
                f"backends.{i}.bootstrap_port: only a prefill server has a bootstrap endpoint "
                f"(backend {b.name!r} has role: {b.role})"
            )
    roles = {b.role for b in backends}
    if backends and roles != {"prefill", "decode"}:
        missing = "prefill" if "prefill" not in roles else "decode"
        raise ValueError(
            f"disaggregation.protocol: 'sglang' needs at least one backend with role: {missing} "
            "(an SGLang prefill server answers nothing alone, nor a decode server)"
        )
