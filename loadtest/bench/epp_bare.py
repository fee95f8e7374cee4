"""A bare ext_proc server for the epp benchmark: the floor of any Python endpoint picker.

It names one fixed endpoint and sends every body back, with the EPP's own message builders
(``proxy.epp.messages``) over ``grpc.aio`` on uvloop, and does nothing else: no parsing,
sizing, ranking or reservation. Behind the same Envoy, what it costs is what the protocol
costs in Python; what ``kvroute epp`` costs above it is the walk.

    python -m loadtest.bench.epp_bare PORT HOST:PORT
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from proxy.epp import messages


class Bare:
    """Process: the destination once the body is whole, every body chunk back."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def Process(self, request_iterator: Any, context: Any) -> None:
        body: list[bytes] = []
        while True:
            message = await context.read()
            if message is grpc.aio.EOF or not isinstance(message, pb.ProcessingRequest):
                return
            for out in self.answer(message, body):
                await context.write(out)

    def answer(self, message: pb.ProcessingRequest, body: list[bytes]) -> list[Any]:
        kind = message.WhichOneof("request")
        if kind == "request_body":
            body.append(message.request_body.body)
            if not message.request_body.end_of_stream:
                return []
            return [
                messages.destination([self.target]),
                *messages.body_chunks(body, request=True),
            ]
        if kind == "response_headers":
            return [messages.response_headers({})]
        if kind == "response_body":
            chunk = message.response_body
            return list(messages.body_chunks([chunk.body], request=False, end=chunk.end_of_stream))
        return []


async def serve(port: int, target: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Bare(target), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    uvloop.run(serve(int(args[0]), args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
