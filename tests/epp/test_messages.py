"""The EPP's protocol pieces without Envoy: chunking, the destination answer, refusals, the
subset hint, the name <-> address map, Envoy's header list."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from proxy.epp import messages
from proxy.epp.endpoints import Endpoints, address_of, subset_hint
from tests.support.gateway import gateway_cfg


def test_a_big_body_goes_back_in_chunks_of_at_most_62000_bytes() -> None:
    chunks = [b"x" * 100_000, b"y" * 30_000, b"z" * 95_000]
    out = list(messages.body_chunks(chunks, request=True))
    pieces = [o.request_body.response.body_mutation.streamed_response for o in out]
    assert all(len(p.body) <= messages.MAX_CHUNK for p in pieces)
    assert b"".join(p.body for p in pieces) == b"".join(chunks)
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]
    middle = list(messages.body_chunks([b"abc"], request=False, end=False))
    assert not middle[0].response_body.response.body_mutation.streamed_response.end_of_stream


def test_destination_sets_the_header_and_the_lb_metadata() -> None:
    answer = messages.destination(["10.0.0.5:8000"])
    common = answer.request_headers.response
    assert common.clear_route_cache
    (header,) = common.header_mutation.set_headers
    assert header.header.key == messages.DESTINATION
    assert header.header.raw_value == b"10.0.0.5:8000"
    lb = answer.dynamic_metadata.fields[messages.LB_NAMESPACE].struct_value
    assert lb.fields[messages.DESTINATION].string_value == "10.0.0.5:8000"


def test_immediate_response_keeps_status_body_and_headers() -> None:
    answer = messages.immediate(429, b'{"error": {}}', {"retry-after": "2"}, "busy")
    imm = answer.immediate_response
    assert imm.status.code == 429 and imm.body == b'{"error": {}}' and imm.details == "busy"
    assert imm.headers.set_headers[0].header.raw_value == b"2"
    assert messages.immediate(499, b"", {}, "x").immediate_response.status.code == 500


def _with_subset(value: struct_pb2.Value) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    hint = struct_pb2.Struct()
    hint.fields[messages.SUBSET_KEY].CopyFrom(value)
    request.metadata_context.filter_metadata[messages.SUBSET_NAMESPACE].CopyFrom(hint)
    return request


def test_subset_hint_as_a_list_or_a_string() -> None:
    listed = struct_pb2.Value()
    listed.list_value.values.add().string_value = "10.0.0.1:8000"
    listed.list_value.values.add().string_value = "10.0.0.2:8000"
    assert subset_hint(_with_subset(listed)) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    joined = struct_pb2.Value(string_value="10.0.0.1:8000, 10.0.0.2:8000")
    assert subset_hint(_with_subset(joined)) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert subset_hint(pb.ProcessingRequest()) is None


def test_endpoints_map_names_and_addresses() -> None:
    cfg = gateway_cfg(
        [
            {"name": "a", "url": "http://10.0.0.1:8000", "kind": "contiguous"},
            {"name": "b", "url": "http://[fd00::2]:9000/v1", "kind": "contiguous"},
        ]
    )
    endpoints = Endpoints(cfg)
    assert endpoints.address == {"a": "10.0.0.1:8000", "b": "[fd00::2]:9000"}
    assert endpoints.names_outside(["[fd00::2]:9000", "1.2.3.4:1"]) == {"a"}
    assert endpoints.names_outside([]) == {"a", "b"}
    assert address_of("https://10.0.0.9") == "10.0.0.9:443"


def test_header_map_reads_raw_values() -> None:
    headers = pb.HttpHeaders()
    headers.headers.headers.append(base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"))
    headers.headers.headers.append(base_pb2.HeaderValue(key="X-Request-Id", value="r1"))
    assert messages.header_map(headers) == {":path": "/v1/completions", "x-request-id": "r1"}
