"""The EPP's ext_proc service driven by a plain gRPC client, message by message.

Where Envoy cannot be made to do something on cue (name another served endpoint, cut the
stream right after the pick, send a body over the limit), a test plays the gateway: a real
gRPC stream to the real EPP over real simulated engines.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proxy.epp import messages
from proxy.epp.endpoints import address_of
from proxy.epp.health import EXT_PROC_SERVICE
from tests.support.epp import Epp, run_epp
from tests.support.gateway import fleet_state, gateway_cfg, wait_until

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class Stream:
    """One Process stream: ``send`` a message, ``recv`` the next answer, ``cancel`` it."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.outbox: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.answers = stub.Process(iter(self.outbox.get, None), timeout=30)

    def send(self, message: pb.ProcessingRequest) -> None:
        self.outbox.put(message)

    def recv(self) -> pb.ProcessingResponse:
        answer: pb.ProcessingResponse = next(self.answers)
        return answer

    def cancel(self) -> None:
        self.answers.cancel()

    def close(self) -> None:
        self.outbox.put(None)
        self.channel.close()


def headers(values: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    listed = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=listed), end_of_stream=end)


def request_headers(path: str = "/v1/chat/completions", end: bool = False) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": path, "content-type": "application/json"}
    return pb.ProcessingRequest(request_headers=headers(values, end))


def request_body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def served_by(address: str) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(
        response_headers=headers({":status": "200", "content-type": "application/json"})
    )
    lb = struct_pb2.Struct()
    lb.update({messages.SERVED: address})
    message.metadata_context.filter_metadata[messages.LB_NAMESPACE].CopyFrom(lb)
    return message


@contextmanager
def stream_to(epp: Epp) -> Iterator[Stream]:
    s = Stream(epp.port)
    try:
        yield s
    finally:
        s.close()


@contextmanager
def two_engines(engine_factory: Callable[..., Any], **sections: Any) -> Iterator[tuple[Epp, Any]]:
    engines = [engine_factory(name=n) for n in ("a", "b")]
    backends = [{"name": e.name, "url": e.url, "kind": "contiguous"} for e in engines]
    with run_epp(gateway_cfg(backends, **sections)) as epp:
        wait_until(lambda: all(b["report"] for b in fleet_state(epp.url)["backends"]))
        yield epp, engines


def inflight(epp: Epp) -> int:
    return sum(b["overlay"]["inflight"] for b in fleet_state(epp.url)["backends"])


def destination_of(answer: pb.ProcessingResponse) -> str:
    (header,) = answer.request_headers.response.header_mutation.set_headers
    assert header.header.key == messages.DESTINATION
    return header.header.raw_value.decode()


def test_the_served_endpoint_is_credited_and_the_pick_released(
    engine_factory: Callable[..., Any],
) -> None:
    with two_engines(engine_factory) as (epp, engines), stream_to(epp) as s:
        s.send(request_headers())
        s.send(request_body(json.dumps(BODY).encode()))
        picked = destination_of(s.recv())
        assert s.recv().request_body.response.body_mutation.streamed_response.end_of_stream
        other = next(e for e in engines if address_of(e.url) != picked)
        s.send(served_by(address_of(other.url)))
        added = s.recv().response_headers.response.header_mutation.set_headers
        ours = {h.header.key: h.header.raw_value for h in added}
        assert ours["x-kvroute-backend"] == other.name.encode()
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
        assert s.recv().response_body.response.body_mutation.streamed_response.end_of_stream
        wait_until(lambda: inflight(epp) == 0, what="the pick's reservation released")
        metrics = httpx.get(epp.url + "/metrics").text
        assert f'backend="{other.name}",class="short",outcome="success"}} 1.0' in metrics


def test_a_stream_cut_after_the_pick_releases_once(engine_factory: Callable[..., Any]) -> None:
    with two_engines(engine_factory) as (epp, _), stream_to(epp) as s:
        s.send(request_headers())
        s.send(request_body(json.dumps(BODY).encode()))
        destination_of(s.recv())
        s.recv()
        assert inflight(epp) == 1
        s.cancel()
        wait_until(lambda: inflight(epp) == 0, what="reservation released")
        metrics = httpx.get(epp.url + "/metrics").text
        assert 'outcome="client_disconnect"} 1.0' in metrics and 'outcome="success"' not in metrics


def test_bad_requests_are_answered_at_once(engine_factory: Callable[..., Any]) -> None:
    with two_engines(engine_factory, limits={"max_body_bytes": 2_000}) as (epp, _):
        cases = [
            ([request_headers(end=True)], 400),
            ([request_headers("/v1/embeddings"), request_body(b"{}")], 404),
            (
                [
                    request_headers(),
                    request_body(b"x" * 1_500, end=False),
                    request_body(b"x" * 600),
                ],
                413,
            ),
            ([request_headers(), request_body(b'{"model": ')], 400),
        ]
        for sent, status in cases:
            with stream_to(epp) as s:
                for message in sent:
                    s.send(message)
                answer = s.recv().immediate_response
                assert answer.status.code == status, (status, answer)
                assert json.loads(answer.body)["error"]["message"]
        assert inflight(epp) == 0


def test_the_gateways_guard_applies(engine_factory: Callable[..., Any]) -> None:
    """The API key (401) and the body's time (408), as the gateway's guard answers them."""
    limits = {"body_timeout_s": 0.3, "body_min_rate_bytes_s": 1_000_000}
    auth = {"api_keys": ["k1"], "forward_client_authorization": "never"}
    with two_engines(engine_factory, limits=limits, auth=auth) as (epp, _):
        with stream_to(epp) as s:
            s.send(request_headers())
            answer = s.recv().immediate_response
            assert answer.status.code == 401
            assert json.loads(answer.body)["error"]["code"] == "invalid_api_key"
        with stream_to(epp) as s:
            keyed = request_headers()
            keyed.request_headers.headers.headers.append(
                base_pb2.HeaderValue(key="authorization", raw_value=b"Bearer k1")
            )
            s.send(keyed)
            s.send(request_body(b'{"model": "sim-model", ', end=False))
            # The rest never comes: the body's deadline answers.
            answer = s.recv().immediate_response
            assert answer.status.code == 408
            assert json.loads(answer.body)["error"]["code"] == "request_timeout"
        assert inflight(epp) == 0


def test_trailers_end_a_body_and_never_pick_twice(engine_factory: Callable[..., Any]) -> None:
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    with two_engines(engine_factory) as (epp, _):
        with stream_to(epp) as s:
            # The body's end comes with the trailers: the pick, the body back, the trailers.
            s.send(request_headers())
            s.send(request_body(json.dumps(BODY).encode(), end=False))
            s.send(trailers)
            destination_of(s.recv())
            assert s.recv().request_body.response.body_mutation.streamed_response.end_of_stream
            assert s.recv().HasField("request_trailers")
            assert inflight(epp) == 1
        wait_until(lambda: inflight(epp) == 0, what="released")
        with stream_to(epp) as s:
            # Trailers after a whole body: answered, and the one pick stays the only one.
            s.send(request_headers())
            s.send(request_body(json.dumps(BODY).encode()))
            destination_of(s.recv())
            s.recv()
            s.send(trailers)
            assert s.recv().HasField("request_trailers")
            assert inflight(epp) == 1
        wait_until(lambda: inflight(epp) == 0, what="released once")


def test_readiness_turns_down_when_the_shutdown_begins(
    engine_factory: Callable[..., Any],
) -> None:
    with two_engines(engine_factory) as (epp, _):
        with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return int(stub.Check(request, timeout=5).status)

            assert status("readiness") == health_pb2.HealthCheckResponse.SERVING
            # What SIGTERM does first (proxy.api.drain): streams in flight run on, no new ones.
            epp.app.state.drain.begin()
            wait_until(
                lambda: status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING,
                what="not ready",
            )
            assert status(EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
