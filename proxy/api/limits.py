"""The guard in front of the API: header size, client API keys, the body, concurrency limit.

A pure ASGI middleware, so that it costs one function call per request and so that the
concurrency count covers a streamed response until its last byte. The server's lean path
(``proxy.api.entry``) serves the inference routes through the same instance and the same
rules (``header_refusal``, ``with_body``, ``read_body``/``whole_body``): one home for each. Every refusal is an
OpenAI-format error: 431 for oversized headers, 400 for more than one ``Authorization``
header, 401 for a missing or wrong key, 413 for a body over ``limits.max_body_bytes``,
408 for a body that does not arrive in time, 429 with ``Retry-After`` when the gateway
already handles ``limits.max_concurrent_requests`` or holds ``limits.max_buffered_body_bytes``
of bodies. API keys are compared in constant time, against every configured key, and never
logged.

An inference request's body is read here, before it takes a concurrency slot: a client
that trickles its body holds no slot (measured before: 20 connections sending a few bytes
of a 100 KB body filled 20 slots and refused a legitimate request for 25 s). The body must
arrive within ``limits.body_timeout_s`` plus one second per ``limits.body_min_rate_bytes_s``
received, and all bodies held at once are bounded by ``limits.max_buffered_body_bytes``
(measured before: 50 stalled 4 MB bodies took 174 MB). The app then reads the body from memory.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.config import Config
from proxy.errors import ApiError
from proxy.gateway.intake import READ_BODY

API_PREFIX = "/v1/"

Refusal = Literal[
    "headers", "auth", "concurrency", "body_timeout", "body_size", "body_budget", "body_aborted"
]
_BODY_REFUSALS: dict[int, Refusal] = {413: "body_size", 408: "body_timeout", 429: "body_budget"}


def too_many_concurrent(limit: int, retry_after: str) -> ApiError:
    """The 429 of a gateway at ``limits.max_concurrent_requests`` (the EPP sheds with it too)."""
    return ApiError(
        429,
        f"the gateway is handling its limit of {limit} concurrent requests; retry shortly",
        type="rate_limit_error",
        code="too_many_concurrent_requests",
        headers={"retry-after": retry_after},
    )


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(len(k) + len(v) for k, v in headers)


def bearer_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k.lower() == b"authorization":
            scheme, _, token = v.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def authorization_count(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(1 for k, _ in headers if k.lower() == b"authorization")


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for k, v in headers:
        if k.lower() == b"content-length":
            return int(v) if v.isdigit() else None
    return None


class BodyBudget:
    """Bytes of request bodies held across all requests; ``take`` refuses past the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


def key_allowed(presented: bytes | None, keys: list[bytes]) -> bool:
    """Constant time in the presented key: every configured key is compared, no early exit."""
    if presented is None:
        return False
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented, k)
    return ok


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        cfg: Config,
        follow: Callable[[Callable[[Config], None]], None] | None = None,
    ) -> None:
        self.app = app
        self.inflight = 0
        self.refused: dict[Refusal, int] = {
            "headers": 0,
            "auth": 0,
            "concurrency": 0,
            "body_timeout": 0,
            "body_size": 0,
            "body_budget": 0,
            "body_aborted": 0,
        }
        # Counts bytes buffered right now: kept across reloads (its size needs a restart).
        self.budget = BodyBudget(cfg.limits.max_buffered_body_bytes)
        self.reconfigure(cfg)
        if follow is not None:
            # A config reload rotates client keys and limits at once.
            follow(self.reconfigure)

    def reconfigure(self, cfg: Config) -> None:
        lim = cfg.limits
        self.max_header_bytes = lim.max_header_bytes
        self.max_concurrent = lim.max_concurrent_requests
        self.max_body = lim.max_body_bytes
        self.body_timeout_s = lim.body_timeout_s
        self.body_min_rate = lim.body_min_rate_bytes_s
        self.retry_after = str(lim.retry_after_s)
        self.keys = [k.encode() for k in cfg.auth.api_keys]

    def header_refusal(
        self, headers: list[tuple[bytes, bytes]], path: str
    ) -> tuple[ApiError, Refusal] | None:
        """What is wrong with a request's headers (size, Authorization, API key), if anything.

        The key is checked only under ``/v1/``; the rest on every path.
        """
        if header_bytes(headers) > self.max_header_bytes:
            err = ApiError(
                431,
                f"request headers are larger than {self.max_header_bytes} bytes",
                code="request_header_fields_too_large",
            )
            return err, "headers"
        if authorization_count(headers) > 1:
            # The key checked and the key forwarded must be the same one: allow only one.
            err = ApiError(
                400, "send at most one Authorization header", code="duplicate_authorization"
            )
            return err, "auth"
        if self.keys and path.startswith(API_PREFIX):
            if not key_allowed(bearer_key(headers), self.keys):
                err = ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                return err, "auth"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        path: str = scope.get("path", "")

        async def refuse(err: ApiError) -> None:
            await err.response()(scope, receive, send)

        refusal = self.header_refusal(headers, path)
        if refusal is not None:
            self.refused[refusal[1]] += 1
            await refuse(refusal[0])
            return
        if not path.startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return

        async def run(body: bytes) -> None:
            # The walk takes the body from the scope (no second read through receive).
            scope[READ_BODY] = body
            await self.app(scope, replay(body, receive), send)

        await self.with_body(lambda: self.read_body(headers, receive), run, refuse)

    async def with_body(
        self,
        read: Callable[[], Awaitable[tuple[bytes, int]]],
        run: Callable[[bytes], Awaitable[None]],
        refuse: Callable[[ApiError], Awaitable[None]],
    ) -> None:
        """Read the whole body (bounded in size, time and memory), then take a slot and run.

        ``read`` gives the body and the budget it holds (``read_body``, or the lean path's
        ``whole_body``); ``refuse`` answers a refusal. The ASGI guard and the server's lean
        path (proxy.api.entry) both go through here: one place for the slot and the budget.
        """
        held = 0
        try:
            try:
                body, held = await read()
            except ApiError as err:
                self.refused[_BODY_REFUSALS.get(err.status, "body_aborted")] += 1
                await refuse(err)
                return
            if self.inflight >= self.max_concurrent:
                self.refused["concurrency"] += 1
                await refuse(self.busy())
                return
            self.inflight += 1
            try:
                await run(body)
            finally:
                self.inflight -= 1
        finally:
            self.budget.give(held)

    def busy(self) -> ApiError:
        return too_many_concurrent(self.max_concurrent, self.retry_after)

    def check_declared(self, headers: list[tuple[bytes, bytes]]) -> None:
        """413 before reading when the declared Content-Length is over the limit."""
        declared = declared_length(headers)
        if declared is not None and declared > self.max_body:
            raise ApiError(
                413,
                f"request body is {declared} bytes, above the limit of {self.max_body}",
                code="request_too_large",
            )

    def take(self, size: int, chunk: bytes) -> None:
        """Admit ``chunk`` (``size``: the body's bytes so far, ``chunk`` included) to the budget."""
        if size > self.max_body:
            raise ApiError(
                413,
                f"request body is above the limit of {self.max_body} bytes",
                code="request_too_large",
                headers={"connection": "close"},
            )
        if not self.budget.take(len(chunk)):
            raise ApiError(
                429,
                "the gateway holds too many request bodies at once; retry shortly",
                type="rate_limit_error",
                code="too_many_request_bodies",
                headers={"retry-after": self.retry_after, "connection": "close"},
            )

    def body_deadline(self, started: float, size: int) -> float:
        """When a body begun at ``started`` with ``size`` bytes so far must have arrived.

        Each byte received buys 1/min_rate s more: a body that keeps the minimum rate never
        times out, a trickle is cut after the grace period.
        """
        return started + self.body_timeout_s + size / self.body_min_rate

    def body_late(self, size: int, waited_s: float) -> ApiError:
        """The 408 of a body that did not arrive within its time (``body_deadline``)."""
        return ApiError(
            408,
            f"the request body did not arrive in time ({size} bytes in {waited_s:.1f}s; at "
            f"least {self.body_min_rate} bytes/s after {self.body_timeout_s:g}s)",
            code="request_timeout",
            headers={"connection": "close"},
        )

    def whole_body(self, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[bytes, int]:
        """A body the server already holds in full: the same size and budget checks, no wait."""
        self.check_declared(headers)
        self.take(len(body), body)
        return body, len(body)

    async def read_body(
        self, headers: list[tuple[bytes, bytes]], receive: Receive
    ) -> tuple[bytes, int]:
        """The body and the budget it holds; ApiError (413, 408, 429) when refused."""
        self.check_declared(headers)
        chunks: list[bytes] = []
        size = held = 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            while True:
                async with asyncio.timeout_at(self.body_deadline(started, size)):
                    message: Message = await receive()
                if message["type"] != "http.request":
                    raise ApiError(400, "the client went away", code="client_disconnect")
                chunk: bytes = message.get("body", b"")
                size += len(chunk)
                self.take(size, chunk)
                held += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks), held
        except TimeoutError:
            self.budget.give(held)
            raise self.body_late(size, loop.time() - started) from None
        except ApiError:
            self.budget.give(held)
            raise


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then passes through (disconnects)."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again
