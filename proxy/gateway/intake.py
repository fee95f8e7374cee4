"""Steps 1-3 of the walk: read and validate the body, size it in KV tokens, classify it.

Bad input is answered here, before any state is touched: a body over the limit is a 413, a
model served nowhere a 404 (``model_not_found``), a request longer than the model's
``max_model_len`` a 400 in vLLM's words (``proxy.gateway.models``), and, where no limit is
known, one larger than any backend's whole cache a 400 (``context_length_exceeded``).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import NamedTuple, Protocol

from starlette.requests import Request

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.core.validation import Endpoint, ParsedRequest, parse_request
from proxy.errors import ApiError
from proxy.gateway import retry_memory
from proxy.gateway.background import Background
from proxy.gateway.bound_route import Bound, BoundPorts, attach, size_or_bound
from proxy.gateway.context import RequestContext
from proxy.gateway.models import ModelsPorts, check_length, route_model
from proxy.routing.policy import Policy, classify
from proxy.state.base import StateStore, StoreUnavailable
from proxy.upstream.client import forward_headers, header
from proxy.upstream.client_auth import strips_client_authorization


class IntakePorts(ModelsPorts, BoundPorts, Protocol):
    """What opening a request uses: what sizing on a bound uses (the fleet view, the
    token-count corrections, affinity, the clock, the reservation's keepers: a request
    routed on its bound records its blocks and shrinks later), and the store (the client's
    earlier failures by retry key) through the task helper."""

    store: StateStore
    tasks: Background


# Where the request guard (proxy.api.limits) leaves the body it read, within the same limit.
READ_BODY = "kvroute.body"


async def read_and_parse(cfg: Config, request: Request, endpoint: Endpoint) -> ParsedRequest:
    """Read the body within ``limits.max_body_bytes`` (declared or streamed) and validate it."""
    limit = cfg.limits.max_body_bytes
    content_type = request.headers.get("content-type")
    read: bytes | None = request.scope.get(READ_BODY)
    if read is not None and len(read) <= limit:
        return parse_request(read, endpoint, cfg.routing.max_tokens_limit, content_type)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body is {declared} bytes, above the limit of {limit}",
            code="request_too_large",
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413,
                f"request body is above the limit of {limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    return parse_request(raw, endpoint, cfg.routing.max_tokens_limit, content_type)


def retry_key(cfg: Config, request: Request, parsed: ParsedRequest) -> str | None:
    """What identifies the client's retry of this request (to keep it off nodes that failed it).

    Namespaced by who sent it (a digest of its API key, or its address when auth is off) and
    by model: another client choosing the same Idempotency-Key must not steer this one.
    """
    headers = request.headers
    key = header(headers, "idempotency-key") or header(headers, "x-request-id")
    if key:
        key = key[:200]
    elif cfg.retry.hash_body:
        key = "body:" + hashlib.blake2b(parsed.raw, digest_size=16).hexdigest()
    else:
        return None
    return f"{client_namespace(cfg, request)}|{parsed.model[:200]}|{key}"


def client_namespace(cfg: Config, request: Request) -> str:
    """Who the client is, for retry keys: its API key's digest, else its address."""
    if cfg.auth.api_keys:
        # The guard let exactly one Authorization header through, holding a valid key.
        token = request.headers.get("authorization", "").encode()
        return "key:" + hashlib.blake2b(token, digest_size=12).hexdigest()
    client = request.client
    return "addr:" + (client.host if client is not None else "-")


def max_capacity(cfg: Config, snap: FleetSnapshot) -> int | None:
    """The largest KV cache any backend has (configured or reported); None while unknown."""
    caps = [b.capacity_tokens for b in cfg.backends if b.capacity_tokens is not None]
    caps += [n.report.capacity_tokens for n in snap.nodes if n.report is not None]
    return max(caps) if caps else None


async def open_request(
    gw: IntakePorts,
    request: Request,
    parsed: ParsedRequest,
    reservation_id: str,
    request_id: str,
    started: float,
    cfg: Config,
    policy: Policy,
) -> RequestContext:
    """Size and classify a valid request, refuse one no backend could ever hold, recall its failures.

    ``cfg``/``policy``: what the request runs on to its end (the gateway's, read once by
    ``handle``).
    """
    deadline = asyncio.get_running_loop().time() + cfg.upstream.total_timeout_s
    sized = await _size(gw, parsed, cfg, policy)
    demand, prompt_tokens = sized.demand, sized.prompt_tokens
    snap = await gw.fleet.snapshot()
    if not sized.limit_known:
        # Unless the model's max_model_len is known (check_length enforced it): the largest cache.
        refuse_beyond_every_backend(cfg, policy, parsed, snap, demand, prompt_tokens)
    key = retry_key(cfg, request, parsed)
    ctx = RequestContext(
        request=request,
        parsed=parsed,
        reservation_id=reservation_id,
        request_id=request_id,
        started=started,
        deadline=deadline,
        prompt_tokens=prompt_tokens,
        counted_prompt_tokens=sized.counted,
        demand=demand,
        cls=classify(demand, cfg.routing.long_threshold_tokens),
        snap=snap,
        retry_key=key,
        upstream_headers=forward_headers(request.headers, strips_client_authorization(cfg.auth)),
        cfg=cfg,
        policy=policy,
        ruled_out=sized.ruled_out,
    )
    if sized.bound is None:
        ctx.affinity = await gw.affinity.key_of(request, parsed)
    else:
        # Its block hashes come with its exact count (proxy.gateway.bound_route).
        ctx.affinity = gw.affinity.session_key(request, parsed)
        attach(gw, ctx, sized.bound)
    if key is not None:
        await _recall_failures(gw, ctx, key)
    return ctx


class Sizing(NamedTuple):
    """What a request costs: its prompt as the gateway and as the servers count it, its KV
    demand, and the backends its model rules out."""

    counted: int
    prompt_tokens: int
    demand: int
    ruled_out: frozenset[str]
    # The model's max_model_len is known (the servers' own limit was checked).
    limit_known: bool
    # Routed on a proven upper bound while its exact count finishes (counted: 0 until then).
    bound: Bound | None = None


async def _size(gw: IntakePorts, parsed: ParsedRequest, cfg: Config, policy: Policy) -> Sizing:
    served, catalog = route_model(gw, parsed, cfg)
    sized = await size_or_bound(gw, parsed, cfg, policy, served, catalog)
    bound = sized if isinstance(sized, Bound) else None
    if isinstance(sized, Bound):
        # The bound is corrected already; the exact count is compared with usage later.
        counted, prompt_tokens, sized = 0, sized.upper.prompt_tokens, sized.upper
    else:
        # As the servers count them, where answers taught the gateway its tokenizer is off.
        counted = sized.prompt_tokens
        prompt_tokens = gw.token_counts.correct(parsed.model, counted)
    demand = sized.total - sized.prompt_tokens + prompt_tokens
    too_small = check_length(catalog, served, parsed, prompt_tokens)
    ruled_out = served.ruled_out | too_small
    return Sizing(counted, prompt_tokens, demand, ruled_out, served.limit is not None, bound)


def refuse_beyond_every_backend(
    cfg: Config,
    policy: Policy,
    parsed: ParsedRequest,
    snap: FleetSnapshot,
    demand: int,
    prompt_tokens: int,
) -> None:
    """400 ``context_length_exceeded`` for a request larger than any backend's whole KV cache."""
    cap = max_capacity(cfg, snap)
    need = demand * (1.0 + cfg.routing.safety_margin) if policy.checks_fit else float(demand)
    if cap is not None and need > cap:
        raise ApiError(
            400,
            f"this request needs {demand} tokens of KV cache ({prompt_tokens} prompt + "
            f"{demand - prompt_tokens} max new), more than any backend holds ({cap}); shorten the prompt or lower max_tokens",
            param="messages" if parsed.endpoint == "chat" else "prompt",
            code="context_length_exceeded",
        )


async def _recall_failures(gw: IntakePorts, ctx: RequestContext, key: str) -> None:
    """Leave out the backends that failed to allocate the client's earlier try (its retry key)."""
    try:
        listed = await gw.tasks.store_call("failed_on", lambda: gw.store.failed_on(key))
    except StoreUnavailable:
        return
    ctx.no_room = retry_memory.still_excluded(listed, ctx.snap, ctx.demand)
    ctx.exclude |= ctx.no_room
