"""Two-step (disaggregated) requests: which backends take which step, and what each step sends.

A disaggregated fleet splits a request in two (docs/disaggregation.md). Step 1 goes to a
prefill server, which computes the prompt's KV, answers one token and holds the blocks.
Step 2 goes to a decode server, which pulls those blocks and generates. vLLM's protocol
(the NIXL connector as vLLM's own toy proxy drives it) is carried in one body field,
``kv_transfer_params``: the gateway asks for a remote decode in step 1 and hands step 2
whatever the prefill server returned, without reading it (its fields change between vLLM
versions; the decode server is their only reader).

Pure: bodies in, bodies out; roles from the config. No I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from proxy.config import BackendConfig

Step = Literal["prefill", "decode"]

# What step 1 asks of the prefill server: compute, hold for a remote decode, answer at once.
_PREFILL_TRANSFER: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields a prefill server rejects or that make no sense for one token (vLLM's proxy drops them).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_only(backends: Iterable[BackendConfig]) -> frozenset[str]:
    """Backends that take step 1 only: never an ordinary request, never a decode."""
    return frozenset(b.name for b in backends if b.role == "prefill")


def not_prefill(backends: Iterable[BackendConfig]) -> frozenset[str]:
    """Backends that cannot take step 1 (``role: decode``)."""
    return frozenset(b.name for b in backends if b.role == "decode")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """Step 1's body: the request, one output token, no stream, and a remote decode asked for."""
    out = copy.deepcopy(dict(body))
    out["kv_transfer_params"] = dict(_PREFILL_TRANSFER)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in _NOT_FOR_PREFILL:
        out.pop(key, None)
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Step 2's body: the client's request as it came, plus the prefill server's transfer params."""
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def transfer_params(answer: object) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill server's answer, or None if it sent none.

    None means the server did not hold the KV for us (not started with a KV connector, or
    it refused the transfer): step 2 then runs as an ordinary request and recomputes.
    """
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        return None
    return params


def worth_two_steps(prompt_tokens: int, cached_on_decode: int, threshold: int) -> bool:
    """Conditional disaggregation: only a prompt with ``threshold`` tokens to compute goes to a
    prefill server; a shorter one (or one mostly cached on a decode server) costs less there
    than a transfer does."""
    return prompt_tokens - cached_on_decode >= threshold


def failure_cause(status: int, body: bytes, allocation: bool) -> str:
    """Why a step failed, for ``x-kvroute-failure-cause``: the error's own code where the
    answer names one (kvroute's answers always do), else what its status and the walk say."""
    try:
        error = orjson.loads(body).get("error") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code:
        return code
    if allocation:
        return "allocation_failure"
    if status in (429, 503):
        return "overload"
    if status == 504:
        return "timeout"
    return "client_error" if status < 500 else "upstream_error"


@dataclass(slots=True)
class TwoStep:
    """One request's progress through the two steps (``RequestContext.two_step``)."""

    # The client's body as parsed and as sent; step 2 sends it again with the transfer params.
    body: dict[str, Any]
    raw: bytes
    # Backends ruled out for the request itself (its model, its length).
    ruled_out: frozenset[str]
    # Backends that never take step 2 (prefill only) and never step 1 (decode only).
    prefill_only: frozenset[str]
    decode_only: frozenset[str]
    # Step 1's outcome: the transfer params (None: not done yet, or to be done again); with
    # SGLang's protocol, the bootstrap fields of the pair under way.
    params: dict[str, Any] | None = None
    prefill_backend: str = ""
    # Every prefill attempt of this request (one per placement).
    prefill_attempts: int = 0
    # Prompt tokens each backend probably caches (conditional disaggregation reads it).
    cached: Mapping[str, int] = field(default_factory=dict)
    # Prefill servers left out for this request (step 2 lost the KV they held).
    prefill_exclude: set[str] = field(default_factory=set)
    # Set once: the request went straight to a decode server (conditional disaggregation).
    skipped: bool = False
    # SGLang's protocol: the pair's prefill half failed first (its decode half was cancelled).
    prefill_failed: bool = False
    # Seconds since arrival (``Server-Timing``): where the time before step 2 went.
    # ``hold_s``: until the decode reservation; ``prefill_s``: step 1 itself (None: no step 1);
    # ``decode_sent_s``: until step 2 was sent (the later of the two when they overlap).
    hold_s: float | None = None
    prefill_s: float | None = None
    decode_sent_s: float | None = None

    @property
    def step(self) -> Step:
        """The step under way: decode once step 1 has answered (or was skipped)."""
        return "decode" if self.params is not None or self.skipped else "prefill"

    def headers(self) -> dict[str, str]:
        """What the answer tells the client about step 1, and where the time went."""
        out: dict[str, str] = {}
        timing = self.server_timing()
        if timing:
            out["server-timing"] = timing
        if self.prefill_backend:
            out["x-kvroute-prefill-backend"] = self.prefill_backend
            out["x-kvroute-prefill-attempts"] = str(self.prefill_attempts)
        return out

    def server_timing(self) -> str:
        """The W3C ``Server-Timing`` value (milliseconds): the hold, step 1, step 2's send.

        A benchmark or a browser's devtools reads what part of the time to first token was
        the wait for a decode server, the prefill, or the decode server's own (the rest).
        """
        parts = (
            ("hold", self.hold_s),
            ("prefill", self.prefill_s),
            ("decode_sent", self.decode_sent_s),
        )
        return ", ".join(f"{name};dur={1000 * s:.1f}" for name, s in parts if s is not None)
