"""One ext_proc stream: one HTTP request and its answer, message by message.

The order Envoy expects in ``FULL_DUPLEX_STREAMED`` mode: the request headers get no
answer until the body has arrived whole (``end_of_stream``) and been placed; then the
headers' answer (the destination), then the body sent back chunk by chunk, then any
trailers. The response's headers and body chunks are answered as they come, each body
chunk sent back at once, so a stream reaches the client event by event.

The stream is read and written with ``context.read``/``context.write`` in one task. When
the client or the gateway goes away, grpc cancels that task and the ``finally`` releases
the reservation; nothing else holds it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from proxy.core.redact import safe_request_id
from proxy.core.validation import parse_request
from proxy.epp import messages
from proxy.epp.bodiless import MODELS_PATH, Bodiless
from proxy.epp.door import Pick, Refusal, endpoint_of, pick
from proxy.epp.endpoints import Endpoints, served_endpoint, subset_hint
from proxy.epp.guard import EppGuard
from proxy.epp.learn import Answer
from proxy.errors import ApiError
from proxy.gateway.walk import Gateway

log = logging.getLogger("kvroute.epp")


class Stream(Protocol):
    """The part of ``grpc.aio.ServicerContext`` an exchange uses."""

    async def read(self) -> object: ...
    async def write(self, message: pb.ProcessingResponse) -> None: ...
    def peer(self) -> str: ...


class Exchange:
    """The state of one stream: the request as it arrives, then its answer."""

    def __init__(
        self, gw: Gateway, endpoints: Endpoints, guard: EppGuard, bodiless: Bodiless
    ) -> None:
        self.gw = gw
        self.endpoints = endpoints
        self.guard = guard
        self.bodiless = bodiless
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        # Body bytes counted in the guard's budget (given back when the stream ends).
        self.held = 0
        # The loop's time at the request headers: the body's deadline counts from there.
        self.started: float | None = None
        self.subset: list[str] | None = None
        self.answer: Answer | None = None
        self.slot = False
        self.decided = False
        self.done = False

    async def run(self, stream: Stream) -> None:
        """Answer every message until the stream ends; release whatever it still holds."""
        try:
            while not self.done:
                message = await self._next(stream)
                if message is None:
                    return
                for out in await self.on(message, stream.peer()):
                    await stream.write(out)
        finally:
            self.close()

    async def _next(self, stream: Stream) -> pb.ProcessingRequest | None:
        """The next message; while the request body arrives, within its deadline (then a 408
        is written and the stream ends: None)."""
        if self.started is None or self.answer is not None:
            message = await stream.read()
        else:
            try:
                async with asyncio.timeout_at(self.guard.body_deadline(self.started, self.size)):
                    message = await stream.read()
            except TimeoutError:
                waited = asyncio.get_running_loop().time() - self.started
                late = self.guard.body_late(self.size, waited)
                for out in self._refuse(Refusal.of_error(late, self._request_id())):
                    await stream.write(out)
                return None
        if message is grpc.aio.EOF or not isinstance(message, pb.ProcessingRequest):
            return None
        return message

    def close(self) -> None:
        if self.answer is not None:
            self.answer.end("closed")
        if self.slot:
            self.slot = False
            self.guard.leave()
        if self.held:
            self.guard.give(self.held)
            self.held = 0

    async def on(self, message: pb.ProcessingRequest, peer: str) -> list[pb.ProcessingResponse]:
        """The answers to one message (none while the request body is still arriving)."""
        if self.subset is None:
            self.subset = subset_hint(message)
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message.request_headers, peer)
        if kind == "request_body":
            return await self._request_body(message.request_body, peer)
        if kind == "request_trailers":
            # The body ended with its trailers (else it was decided at its end_of_stream).
            decided = [] if self.decided else await self._decide(peer)
            return [*decided, messages.trailers(request=True)]
        if kind == "response_headers":
            self._served(served_endpoint(message))
            return self._response_headers(message.response_headers)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            self._ended()
            return [messages.trailers(request=False)]
        return []

    def _request_headers(self, headers: pb.HttpHeaders, peer: str) -> list[pb.ProcessingResponse]:
        self.headers = messages.header_map(headers)
        self.guard.follow(self.gw.cfg)
        path = self.headers.get(":path", "").partition("?")[0]
        refused = self.guard.at_headers(self.headers, path)
        if refused is not None:
            return self._refuse(Refusal.of_error(refused, self._request_id()))
        if headers.end_of_stream:
            return self._bodiless(path)
        self.started = asyncio.get_running_loop().time()
        return []

    def _bodiless(self, path: str) -> list[pb.ProcessingResponse]:
        """A request without a body: the model list answered here, anything else passed on
        (the stream stays open: its answer comes back through it)."""
        self.decided = True
        endpoint = endpoint_of(path)
        if endpoint is not None:
            # A completion without a body: the gateway's own answer to one (a 400).
            cfg = self.gw.cfg
            try:
                parse_request(b"", endpoint, cfg.routing.max_tokens_limit)
            except ApiError as err:
                return self._refuse(Refusal.of_error(err, self._request_id()))
        if path == MODELS_PATH and self.headers.get(":method", "GET") == "GET":
            listed = self.bodiless.models(self.gw)
            if listed is not None:
                json = {"content-type": "application/json"}
                return [messages.immediate(200, listed, json, "models")]
        backend = self.bodiless.backend(self.gw, self._leave_out())
        if backend is None:
            unavailable = self.bodiless.unavailable()
            return self._refuse(Refusal.of_error(unavailable, self._request_id()))
        return [messages.destination([self.endpoints.address[backend]])]

    def _leave_out(self) -> frozenset[str]:
        """The backends the subset hint leaves out (none without a hint)."""
        if self.subset is None:
            return frozenset()
        return self.endpoints.names_outside(self.subset)

    async def _request_body(self, body: pb.HttpBody, peer: str) -> list[pb.ProcessingResponse]:
        chunk = body.body
        self.size += len(chunk)
        try:
            self.guard.take(self.size, chunk)
        except ApiError as err:
            return self._refuse(Refusal.of_error(err, self._request_id()))
        self.held += len(chunk)
        if chunk:
            self.body.append(chunk)
        if not body.end_of_stream or self.decided:
            return []
        return await self._decide(peer)

    async def _decide(self, peer: str) -> list[pb.ProcessingResponse]:
        """The whole body is here: take a slot, place it, then send the destination and the
        body back. Runs once a stream: a second pick would leave the first one's reservation
        with nobody to release it."""
        self.decided = True
        if not self.guard.enter():
            return self._refuse(Refusal.of_error(self.guard.busy(), self._request_id()))
        self.slot = True
        leave_out = self._leave_out()
        # The address the gateway appended last (the leftmost ones are the client's to write).
        client = self.headers.get("x-forwarded-for", "").rpartition(",")[2].strip() or peer
        try:
            placed = await pick(self.gw, self.headers, b"".join(self.body), leave_out, client)
        except Exception:
            log.exception("the EPP failed to place a request")
            err = ApiError(500, "internal error", type="server_error", code="internal_error")
            placed = Refusal.of_error(err, self._request_id())
        if isinstance(placed, Refusal):
            return self._refuse(placed)
        return self._placed(placed)

    def _placed(self, placed: Pick) -> list[pb.ProcessingResponse]:
        # No await between the pick and this line: the reservation is always this stream's.
        self.answer = Answer(self.gw, placed)
        address = self.endpoints.address.get(placed.backend, "")
        out = [messages.destination([address]), *messages.body_chunks(self.body, request=True)]
        # The answers hold the body now; the walk keeps its parsed copy (ParsedRequest.raw).
        self.body = []
        return out

    def _refuse(self, refusal: Refusal) -> list[pb.ProcessingResponse]:
        self.done = True
        self.body = []
        return [messages.immediate(refusal.status, refusal.body, refusal.headers, refusal.reason)]

    def _served(self, address: str | None) -> None:
        """The gateway names the endpoint that served (it may have retried down the list)."""
        if self.answer is not None and address is not None:
            name = self.endpoints.name.get(address)
            if name is not None:
                self.answer.served = name

    def _response_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        if self.answer is None:
            return [messages.response_headers({})]
        got = messages.header_map(headers)
        code = got.get(":status", "")
        status = int(code) if code.isdigit() else 0
        ours = self.answer.headers(status, got.get("content-type", ""), got.get("retry-after"))
        if headers.end_of_stream:
            self._ended()
        return [messages.response_headers(ours)]

    def _response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.answer is not None:
            self.answer.chunk(body.body)
        out = list(messages.body_chunks([body.body], request=False, end=body.end_of_stream))
        if body.end_of_stream:
            self._ended()
        return out

    def _ended(self) -> None:
        if self.answer is not None:
            self.answer.end("answered")

    def _request_id(self) -> str:
        """The request's id for a refusal's ``x-request-id`` (the client's, when it is safe)."""
        return safe_request_id(self.headers.get("x-request-id")) or "-"
