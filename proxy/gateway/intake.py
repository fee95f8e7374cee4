"""Steps 1-3 of the walk: read and validate the body, size it in KV tokens, classify it.

Bad input is answered here, before any state is touched: a body over the limit is a 413, a
model served nowhere a 404 (``model_not_found``), a request longer than the model's
``max_model_len`` a 400 in vLLM's words (``proxy.gateway.models``), and, where no limit is
known, one larger than any backend's whole cache a 400 (``context_length_exceeded``).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING

from starlette.requests import Request

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.core.validation import Endpoint, ParsedRequest, parse_request
from proxy.errors import ApiError
from proxy.gateway import retry_memory
from proxy.gateway.bound_route import Bound, attach, size_or_bound
from proxy.gateway.context import RequestContext
from proxy.gateway.models import check_length, route_model
from proxy.routing.policy import Policy, classify
from proxy.state.base import StoreUnavailable
from proxy.upstream.client import forward_headers, header
from proxy.upstream.client_auth import strips_client_authorization

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway


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
    gw: Gateway,
    request: Request,
    parsed: ParsedRequest,
    reservation_id: str,
    request_id: str,
    started: float,
    cfg: Config | None = None,
    policy: Policy | None = None,
) -> RequestContext:
    """Size and classify a valid request, refuse one no backend could ever hold, recall its failures.

    ``cfg``/``policy``: what the request runs on to its end (the gateway's, read once by
    ``handle``); absent, the gateway's current ones.
    """
    cfg = gw.cfg if cfg is None else cfg
    policy = gw.policy if policy is None else policy
    rcfg = cfg.routing
    deadline = asyncio.get_running_loop().time() + cfg.upstream.total_timeout_s
    served, catalog = route_model(gw, parsed, cfg)
    sized = await size_or_bound(gw, parsed, cfg, policy, served, catalog)
    bound = sized if isinstance(sized, Bound) else None
    if isinstance(sized, Bound):
        # Routed on a proven upper bound (already corrected) while the exact count finishes.
        sized = sized.upper
        counted, prompt_tokens = 0, sized.prompt_tokens
    else:
        # As the servers count them, where answers taught the gateway its tokenizer is off.
        counted = sized.prompt_tokens
        prompt_tokens = gw.token_counts.correct(parsed.model, counted)
    demand = sized.total - sized.prompt_tokens + prompt_tokens
    too_small = check_length(catalog, served, parsed, prompt_tokens)
    cls = classify(demand, rcfg.long_threshold_tokens)
    snap = await gw.fleet.snapshot()
    cap = max_capacity(cfg, snap)
    need = demand * (1.0 + rcfg.safety_margin) if policy.checks_fit else float(demand)
    # With the model's max_model_len known, that is the limit the servers enforce (above).
    if served.limit is None and cap is not None and need > cap:
        raise ApiError(
            400,
            f"this request needs {demand} tokens of KV cache ({prompt_tokens} prompt + "
            f"{demand - prompt_tokens} max new), more than any backend holds ({cap}); shorten the prompt or lower max_tokens",
            param="messages" if parsed.endpoint == "chat" else "prompt",
            code="context_length_exceeded",
        )
    key = retry_key(cfg, request, parsed)
    ctx = RequestContext(
        request=request,
        parsed=parsed,
        reservation_id=reservation_id,
        request_id=request_id,
        started=started,
        deadline=deadline,
        prompt_tokens=prompt_tokens,
        counted_prompt_tokens=counted,
        demand=demand,
        cls=cls,
        snap=snap,
        retry_key=key,
        upstream_headers=forward_headers(request.headers, strips_client_authorization(cfg.auth)),
        cfg=cfg,
        policy=policy,
        ruled_out=served.ruled_out | too_small,
    )
    if bound is None:
        ctx.affinity = await gw.affinity.key_of(request, parsed)
    else:
        ctx.affinity = gw.affinity.session_key(request, parsed)
        attach(gw, ctx, bound)
    if key is not None:
        try:
            listed = await gw.store_call("failed_on", lambda: gw.store.failed_on(key))
            ctx.no_room = retry_memory.still_excluded(listed, snap, demand)
            ctx.exclude |= ctx.no_room
        except StoreUnavailable:
            pass
    return ctx
