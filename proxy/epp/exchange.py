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

import logging
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from proxy.epp import messages
from proxy.epp.door import Pick, Refusal, pick
from proxy.epp.endpoints import Endpoints, served_endpoint, subset_hint
from proxy.epp.learn import Answer
from proxy.epp.shedding import Shedding
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

    def __init__(self, gw: Gateway, endpoints: Endpoints, shedding: Shedding) -> None:
        self.gw = gw
        self.endpoints = endpoints
        self.shedding = shedding
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.subset: list[str] | None = None
        self.answer: Answer | None = None
        self.slot = False
        self.done = False

    async def run(self, stream: Stream) -> None:
        """Answer every message until the stream ends; release whatever it still holds."""
        try:
            while not self.done:
                message = await stream.read()
                if message is grpc.aio.EOF or not isinstance(message, pb.ProcessingRequest):
                    return
                for out in await self.on(message, stream.peer()):
                    await stream.write(out)
        finally:
            self.close()

    def close(self) -> None:
        if self.answer is not None:
            self.answer.end("closed")
        if self.slot:
            self.slot = False
            self.shedding.leave()

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
            return [*await self._decide(peer), messages.trailers(request=True)]
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
        if not self.shedding.enter():
            return self._refuse(Refusal.of_error(self.shedding.busy(), self._request_id()))
        self.slot = True
        if headers.end_of_stream:
            return self._no_body()
        return []

    def _no_body(self) -> list[pb.ProcessingResponse]:
        """A request without a body: nothing to place (the walk's own 400 for an empty body)."""
        err = ApiError(400, "the request has no body", code="invalid_body")
        return self._refuse(Refusal.of_error(err, self._request_id()))

    async def _request_body(self, body: pb.HttpBody, peer: str) -> list[pb.ProcessingResponse]:
        limit = self.gw.cfg.limits.max_body_bytes
        self.size += len(body.body)
        if self.size > limit:
            err = ApiError(
                413, f"request body is above the limit of {limit} bytes", code="request_too_large"
            )
            return self._refuse(Refusal.of_error(err, self._request_id()))
        if body.body:
            self.body.append(body.body)
        if not body.end_of_stream:
            return []
        return await self._decide(peer)

    async def _decide(self, peer: str) -> list[pb.ProcessingResponse]:
        """The whole body is here: place it, then send the destination and the body back."""
        leave_out = (
            frozenset() if self.subset is None else self.endpoints.names_outside(self.subset)
        )
        client = self.headers.get("x-forwarded-for", "").partition(",")[0].strip() or peer
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
        return [
            messages.destination([address]),
            *messages.body_chunks(self.body, request=True),
        ]

    def _refuse(self, refusal: Refusal) -> list[pb.ProcessingResponse]:
        self.done = True
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
        status = int(got.get(":status", "0") or 0)
        ours = self.answer.headers(status, got.get("content-type", ""))
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
        return self.headers.get("x-request-id", "") or "-"
