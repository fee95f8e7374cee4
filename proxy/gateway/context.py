"""The per-request values of one walk through the gateway (uvicorn's ``RequestResponseCycle`` habit).

Everything that used to travel as 7-8 positional arguments between the gateway's steps lives
here: what the client sent, what it costs, where it may still go, and what to answer if no
other backend serves it. The ``Gateway`` keeps only what outlives a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from starlette.requests import Request
from starlette.responses import Response

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.core.two_step import TwoStep
from proxy.core.validation import ParsedRequest
from proxy.errors import UpstreamFailure
from proxy.gateway.affinity import AffinityKey
from proxy.routing.policy import Policy, RequestClass

# Label values of kvroute_attempts_total{result}: how one attempt on one backend ended.
AttemptResult = Literal[
    "ok",
    "timeout",
    "connect_error",
    "broken",
    "garbage",
    "allocation",
    "overload",
    "server_error",
    "client_error",
]

# How each upstream failure is counted on kvroute_attempts_total.
FAILURE_RESULTS: dict[UpstreamFailure, AttemptResult] = {
    "connect_timeout": "timeout",
    "ttfb_timeout": "timeout",
    "connect_error": "connect_error",
    "idle_timeout": "timeout",
    "total_timeout": "timeout",
    "first_event_timeout": "timeout",
    "broken": "broken",
    "bad_response": "garbage",
}

# Label values of kvroute_requests_total{outcome}: how the whole request ended.
RequestResult = Literal[
    "success",
    "rejected",
    "allocation_failure",
    "upstream_error",
    "upstream_timeout",
    "client_disconnect",
    "no_fit",
    "unavailable",
    # A stream still running when the gateway's shutdown drain time ran out.
    "shutdown",
]


@dataclass(slots=True)
class RequestContext:
    """One request's walk: set up by intake, advanced by placement and each attempt."""

    request: Request
    parsed: ParsedRequest
    # Our reservation id in the store: a fresh uuid, never a client-chosen string.
    reservation_id: str
    # The id the client sees in x-request-id (its own header, or the reservation id).
    request_id: str
    started: float  # perf_counter at arrival
    deadline: float  # the loop's clock: the whole request's time limit
    prompt_tokens: int
    demand: int
    cls: RequestClass
    snap: FleetSnapshot
    retry_key: str | None
    upstream_headers: dict[str, str]
    # The config and policy the request started with: a reload while it runs (proxy.api.reload)
    # does not change its timeouts, attempts or ranking halfway.
    cfg: Config
    policy: Policy
    exclude: set[str] = field(default_factory=set)
    # The gateway's own prompt count before any learned correction (``proxy.gateway.token_counts``
    # compares it with the server's usage; 0: not counted).
    counted_prompt_tokens: int = 0
    # Backends that do not serve the request's model or whose max_model_len is too small.
    ruled_out: frozenset[str] = frozenset()
    # Nodes known to have failed to allocate this request (its attempts, or the client's
    # earlier try by retry key): left out of ranking, but judged on memory, not as unavailable.
    no_room: set[str] = field(default_factory=set)
    failed_on: list[str] = field(default_factory=list)
    backend: str = ""
    attempts: int = 0
    # Retries taken from the retry budget (given back when the request ends).
    retries: int = 0
    # The retry now due holds its budget slot (taken before a hold, not again after it).
    retry_slot_taken: bool = False
    # The routing decision's latency is observed once, at the first ranking.
    decided: bool = False
    # When waiting in the admission queue must end (set on first entry, monotonic clock).
    queue_deadline: float | None = None
    # When holding at the gateway began (monotonic; queueing backends bound it by their wait).
    hold_started: float | None = None
    # How long it was held before its first placement (``Server-Timing: hold``).
    held_s: float | None = None
    # The answer if we stop now after an upstream failure; None while nothing failed.
    failure: Response | None = None
    # How the request ends if ``failure`` is the answer (kvroute_requests_total{outcome}).
    failure_outcome: RequestResult = "upstream_error"
    # Prompt block hashes and session for prefix/session affinity (None: affinity off).
    affinity: AffinityKey | None = None
    # A disaggregated request's two steps (``proxy.gateway.disaggregated``); None: one step.
    two_step: TwoStep | None = None
    # False for step 1 of two: its answer is not the request's, so its success is not counted.
    counts_request: bool = True
    # Where its output ratio is learned (``MemoryPressure.keys``), worked out once: the
    # request's ranking, placement and answer all ask, and each asking hashed the credential.
    output_keys: list[str] | None = None
    # (max new tokens, expected output) as a ranking projected it (``MemoryPressure.flight_for``):
    # placement reuses it. None: no ranking projected this request.
    expected_output: tuple[int, int] | None = None
    # (backend, predicted TTFT in seconds, the loop's time at placement) for a stream placed
    # on a queueing backend: checked at its first event (``proxy.gateway.ttft_check``).
    predicted_ttft: tuple[str, float, float] | None = None
    # The loop's time at a stream's first event (its decode rate is measured from there).
    first_event_at: float | None = None

    def answer_headers(
        self,
        backend: str,
        upstream: Mapping[str, str] | None = None,
        only: frozenset[str] | None = None,
    ) -> dict[str, str]:
        """The headers of any answer: the upstream's (optionally only ``only``), then ours on top."""
        merged = {k: v for k, v in (upstream or {}).items() if only is None or k.lower() in only}
        merged.update(
            {
                "x-kvroute-backend": backend,
                "x-kvroute-class": self.cls,
                "x-kvroute-demand-tokens": str(self.demand),
                "x-kvroute-attempts": str(self.attempts),
                "x-request-id": self.request_id,
            }
        )
        if self.two_step is not None:
            merged.update(self.two_step.headers())
        elif self.held_s is not None:
            merged["server-timing"] = f"hold;dur={1000 * self.held_s:.1f}"
        return merged
