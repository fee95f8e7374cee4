"""The pure parts of disaggregated serving: roles in config and discovery, the two bodies of
vLLM's NIXL protocol, conditional disaggregation and the prefill server's choice."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.backends.discovery_kubernetes import slice_backends
from proxy.config import ConfigError, DiscoveryConfig, parse_config
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.two_step import (
    TwoStep,
    decode_body,
    failure_cause,
    prefill_body,
    prefill_only,
    transfer_params,
    worth_two_steps,
)
from proxy.routing.policy import RouteRequest
from proxy.routing.prefill_wait import PrefillWaitPolicy
from proxy.routing.queueing import Rates
from tests.backends.test_discovery import POOLS, endpoint_slice


def cfg_with(roles: dict[str, Any]) -> Any:
    backends = [{"name": n, "url": f"http://{n}:8000", "role": r} for n, r in roles.items()]
    return parse_config({"backends": backends}, "test", environ={})


def test_role_defaults_to_both_and_a_wrong_one_names_key_and_value() -> None:
    cfg = cfg_with({"a": "prefill", "b": "decode", "c": "both"})
    assert prefill_only(cfg.backends) == frozenset({"a"})
    plain = parse_config({"backends": [{"name": "x", "url": "http://x:1"}]}, "t", environ={})
    assert plain.backends[0].role == "both"
    assert plain.disaggregation.min_uncached_prompt_tokens == 512
    with pytest.raises(ConfigError) as err:
        cfg_with({"a": "prefil"})
    assert "backends[0] (name: a).role" in str(err.value) and "'prefil'" in str(err.value)


def test_discovery_reads_the_role_label_and_falls_back_to_both() -> None:
    cfg = DiscoveryConfig(type="kubernetes", port=8000, kind="vllm")
    labels = {"kvroute.io/role": "prefill"}
    obj = endpoint_slice("pf", [("pf-0", "10.0.0.1", True)], port=8000, labels=labels)
    assert [b.role for b in slice_backends(cfg, obj, POOLS)] == ["prefill"]
    obj["metadata"]["labels"]["kvroute.io/role"] = "nonsense"
    assert [b.role for b in slice_backends(cfg, obj, POOLS)] == ["both"]


def test_step_1_asks_one_token_no_stream_and_a_remote_decode_the_client_body_untouched() -> None:
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 500,
        "max_completion_tokens": 500,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 10,
    }
    first = prefill_body(body)
    assert first["max_tokens"] == 1 and first["max_completion_tokens"] == 1
    assert first["stream"] is False
    assert "stream_options" not in first and "min_tokens" not in first
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 500 and "kv_transfer_params" not in body
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 9}
    second = decode_body(body, params)
    assert second["kv_transfer_params"] == params and second["stream"] is True
    assert second["max_tokens"] == 500 and second["stream_options"] == {"include_usage": True}


def test_transfer_params_are_read_only_from_an_answer_that_has_them() -> None:
    assert transfer_params({"kv_transfer_params": {"remote_port": 1}}) == {"remote_port": 1}
    for answer in ({}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}, [1], "x"):
        assert transfer_params(answer) is None


def test_conditional_disaggregation_counts_only_what_the_decode_server_lacks() -> None:
    assert worth_two_steps(1000, 0, 512)
    assert not worth_two_steps(1000, 600, 512)
    assert not worth_two_steps(100, 0, 512)


def test_the_step_under_way_and_the_headers_it_gives() -> None:
    two = TwoStep({}, b"{}", frozenset(), frozenset({"p"}), frozenset())
    assert two.step == "prefill" and two.headers() == {}
    two.params, two.prefill_backend, two.prefill_attempts = {"x": 1}, "p", 2
    assert two.step == "decode"
    assert two.headers() == {"x-kvroute-prefill-backend": "p", "x-kvroute-prefill-attempts": "2"}


def test_server_timing_says_where_the_time_before_step_2_went() -> None:
    two = TwoStep({}, b"{}", frozenset(), frozenset({"p"}), frozenset())
    two.hold_s, two.decode_sent_s = 0.25, 0.2504
    # Skipped step 1 (a short prompt): no prefill entry.
    assert two.headers() == {"server-timing": "hold;dur=250.0, decode_sent;dur=250.4"}
    two.prefill_s, two.prefill_backend = 1.5, "p"
    assert two.headers()["server-timing"] == (
        "hold;dur=250.0, prefill;dur=1500.0, decode_sent;dur=250.4"
    )


def node(name: str, waiting: int = 0, inflight: int = 0, reserved: int = 0) -> NodeView:
    report = MemoryReport(
        100_000, 100_000, 100_000, "paged", 16, waiting=waiting, queueing=True, reported_at=0.0
    )
    return NodeView(
        name, report=report, overlay=Overlay(reserved_tokens=reserved, inflight=inflight)
    )


def test_prefill_goes_where_the_backlog_over_the_rate_is_shortest_cache_hits_subtracted() -> None:
    snap = FleetSnapshot((node("a", inflight=4, reserved=8_000), node("b")), 0.0)
    policy = PrefillWaitPolicy()
    assert policy.rank(snap, RouteRequest(4_000, "short"), 0.0) == ["b", "a"]
    # "a" caches the whole prompt: its backlog (4 x 2000 tokens) still costs more than b's 4000.
    cached = RouteRequest(4_000, "short", cached={"a": 4_000})
    assert policy.rank(snap, cached, 0.0) == ["b", "a"]
    # Twice as fast a prefill rate on "a", and the prompt cached there: "a" first.
    fast = PrefillWaitPolicy(rates={"a": Rates(prefill_tokens_per_s=40_000.0)})
    assert fast.rank(snap, cached, 0.0) == ["a", "b"]
    # Never refuses for memory: a node with no room still ranks (it queues).
    assert fast.rank(snap, RouteRequest(10**9, "long"), 0.0) != []


def test_a_failed_steps_cause_is_the_errors_own_code_else_the_status_and_the_walks() -> None:
    named = b'{"error": {"message": "x", "code": "no_backend_fits_capacity"}}'
    assert failure_cause(503, named, allocation=False) == "no_backend_fits_capacity"
    unnamed = b'{"error": {"message": "KV cache out of memory", "code": null}}'
    assert failure_cause(503, unnamed, allocation=True) == "allocation_failure"
    assert failure_cause(503, unnamed, allocation=False) == "overload"
    assert failure_cause(504, b"", allocation=False) == "timeout"
    assert failure_cause(502, b"not json", allocation=False) == "upstream_error"
    assert failure_cause(400, b"[1]", allocation=False) == "client_error"
