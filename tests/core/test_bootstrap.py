"""SGLang's bootstrap fields: what a PD router adds to a request, and how a lost transfer reads."""

from __future__ import annotations

import pytest

from proxy.core.bootstrap import (
    ROOM_BITS,
    bootstrap_fields,
    bootstrap_host,
    decode_body,
    new_room,
    prefill_body,
    transfer_lost,
)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://10.0.0.7:30000", "10.0.0.7"),
        ("http://prefill-0.svc:8000/", "prefill-0.svc"),
        ("http://user:pw@prefill-1:8000", "prefill-1"),
        # An IPv6 address goes in brackets, as SGLang's router writes it.
        ("http://[fd00::1]:30000", "[fd00::1]"),
    ],
)
def test_the_bootstrap_host_is_the_prefill_servers_own(url: str, host: str) -> None:
    assert bootstrap_host(url) == host


def test_a_url_without_a_host_is_refused() -> None:
    with pytest.raises(ValueError, match="no host"):
        bootstrap_host("unix:///run/sglang.sock")


def test_rooms_are_63_bit_and_fresh() -> None:
    rooms = {new_room() for _ in range(200)}
    assert all(0 <= r < 2**ROOM_BITS for r in rooms)
    assert len(rooms) == 200


def test_both_servers_get_the_same_fields_and_the_decode_the_request_as_it_came() -> None:
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
        "nested": {"a": 1},
    }
    fields = bootstrap_fields("http://10.0.0.7:30000", 8998, 12345)
    assert fields == {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 12345}
    decode = decode_body(body, fields)
    prefill = prefill_body(body, fields)
    assert decode == {**body, **fields}
    # The prefill's answer is dropped: one JSON body, no stream, the rest unchanged.
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["max_tokens"] == 40 and prefill["bootstrap_room"] == 12345
    # The client's body is never changed in place.
    prefill["nested"]["a"] = 2
    assert body["nested"] == {"a": 1} and body["stream"] is True


def test_a_lost_transfer_reads_from_sglangs_own_message() -> None:
    lost = (
        b'{"object":"error","message":"Decode transfer failed for request rank=0 '
        b"decode_req.req.rid='ab' decode_req.req.bootstrap_room=42 with exception "
        b'KVTransferError(bootstrap_room=42): Failed to get kvcache from prefill instance"}'
    )
    assert transfer_lost(lost)
    assert not transfer_lost(b'{"message":"KV cache out of memory"}')
