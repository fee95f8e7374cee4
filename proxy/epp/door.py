"""One request into the gateway's walk, as far as the pick: the EPP's door.

The same steps as ``Gateway.handle`` up to the forward (``proxy.gateway.walk``): parse and
validate (``intake.read_and_parse``), size and classify (``intake.open_request``), then
rank, reserve or hold (``placement.place``). The forward itself is Envoy's. A request the
walk refuses gets the gateway's own answer (status, OpenAI-format body, headers), which the
EPP hands to Envoy as an ``ImmediateResponse``.

The walk reads a Starlette ``Request``; here it is built over the headers Envoy sent and
the body already in memory (``intake.READ_BODY``), so the walk never reads a socket. The
client is watched by the ext_proc stream itself: when it goes away the stream's task is
cancelled, so the request's ``receive`` never reports a disconnect of its own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Scope

from proxy.core.redact import safe_request_id
from proxy.core.validation import Endpoint
from proxy.errors import ApiError
from proxy.gateway import intake, placement
from proxy.gateway.context import RequestContext
from proxy.gateway.walk import Gateway

_ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Headers of a refusal that Envoy sets itself from the body it sends.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True, slots=True)
class Refusal:
    """The gateway's answer when it sends the request nowhere."""

    status: int
    body: bytes
    headers: dict[str, str]
    # Why, in a word (the error's code): Envoy logs it as the immediate response's details.
    reason: str

    @classmethod
    def of(cls, answer: Response) -> Refusal:
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _FRAMING}
        body = bytes(answer.body)
        return cls(answer.status_code, body, headers, _code_of(body))

    @classmethod
    def of_error(cls, err: ApiError, request_id: str) -> Refusal:
        return cls.of(err.response({"x-request-id": request_id}))


@dataclass(slots=True)
class Pick:
    """A request placed: its walk's context, the backend holding its reservation."""

    ctx: RequestContext
    backend: str


def _code_of(body: bytes) -> str:
    """The error code of an OpenAI-format error body ("refused" when it names none)."""
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "refused"
    return str(code) if code else "refused"


async def _never() -> Message:
    """The request's ``receive``: its body is in the scope, and the stream watches the client."""
    await asyncio.get_running_loop().create_future()
    raise AssertionError("unreachable")


def request_of(headers: Mapping[str, str], body: bytes, path: str, client: str) -> Request:
    """A Starlette request over what Envoy sent (pseudo-headers left out)."""
    scope: Scope = {
        "type": "http",
        "http_version": "1.1",
        "method": headers.get(":method", "POST"),
        "scheme": headers.get(":scheme", "http"),
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items() if not k.startswith(":")],
        "client": (client, 0),
        "server": None,
        intake.READ_BODY: body,
    }
    return Request(scope, _never)


def endpoint_of(path: str) -> Endpoint | None:
    return _ENDPOINTS.get(path.partition("?")[0])


async def pick(
    gw: Gateway, headers: Mapping[str, str], body: bytes, leave_out: frozenset[str], client: str
) -> Pick | Refusal:
    """Place and reserve the request, or the gateway's refusal. ``leave_out``: backends the
    subset hint excludes (to the walk they are as if they did not serve the model)."""
    started = time.perf_counter()
    reservation_id = os.urandom(16).hex()
    request_id = safe_request_id(headers.get("x-request-id")) or reservation_id
    path = headers.get(":path", "").partition("?")[0]
    endpoint = endpoint_of(path)
    if endpoint is None:
        err = ApiError(404, f"{path or '/'} is not an inference route", code="not_found")
        return Refusal.of_error(err, request_id)
    cfg, policy = gw.cfg, gw.policy
    request = request_of(headers, body, path, client)
    try:
        parsed = await intake.read_and_parse(cfg, request, endpoint)
        ctx = await intake.open_request(
            gw, request, parsed, reservation_id, request_id, started, cfg, policy
        )
    except ApiError as err:
        gw.metrics.rejected.labels(err.code or "invalid").inc()
        return Refusal.of_error(err, request_id)
    ctx.ruled_out |= leave_out
    try:
        placed = await placement.place(gw, ctx)
    finally:
        gw.budget.release(ctx.retries)
        gw.pressure.forget(ctx)
    if isinstance(placed, Response):
        return Refusal.of(placed)
    return Pick(ctx, placed)
