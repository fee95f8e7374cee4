"""``disaggregation.protocol: sglang`` and ``backends[].bootstrap_port``: defaults and errors."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.config import Config


def cfg(backends: list[dict[str, Any]], protocol: str = "sglang") -> Config:
    return Config.model_validate({"backends": backends, "disaggregation": {"protocol": protocol}})


P = {"name": "p0", "url": "http://p0:30000", "kind": "sglang", "role": "prefill"}
D = {"name": "d0", "url": "http://d0:30000", "kind": "sglang", "role": "decode"}


def test_an_sglang_fleet_with_sglangs_default_bootstrap_port() -> None:
    c = cfg([P, {**P, "name": "p1", "bootstrap_port": 9001}, D])
    assert c.disaggregation.protocol == "sglang"
    assert [b.bootstrap_port for b in c.backends] == [8998, 9001, 8998]


def test_the_nixl_protocol_stays_the_default_and_ignores_roles_both() -> None:
    c = Config.model_validate(
        {"backends": [{**P, "kind": "vllm"}, {"name": "x", "url": "http://x:1"}]}
    )
    assert c.disaggregation.protocol == "nixl"


@pytest.mark.parametrize(
    ("backends", "says"),
    [
        ([P, {"name": "x", "url": "http://x:1"}], "backends.1.role: 'both' is not possible"),
        ([P, {**D, "bootstrap_port": 9000}], "backends.1.bootstrap_port: only a prefill server"),
        ([D], "needs at least one backend with role: prefill"),
        ([P], "needs at least one backend with role: decode"),
        ([{**P, "bootstrap_port": 0}, D], "greater than or equal to 1"),
        ([{**P, "bootstrap_port": 70000}, D], "less than or equal to 65535"),
    ],
)
def test_errors_name_the_key_and_the_value(backends: list[dict[str, Any]], says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        cfg(backends)


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValidationError, match=re.escape("disaggregation.protocol")):
        cfg([P, D], protocol="mooncake")


def test_the_decode_order_defaults_by_protocol_and_a_set_one_wins() -> None:
    # Measured (docs/benchmarks.md, section 10): best fit with vLLM's protocol; spread with
    # SGLang's, where best fit cost a decode preemption a run.
    assert cfg([P, D]).disaggregation.order() == "spread"
    nixl = Config.model_validate({"backends": [{**P, "kind": "vllm"}, {**D, "kind": "vllm"}]})
    assert nixl.disaggregation.order() == "best_fit"
    chosen = Config.model_validate(
        {"backends": [P, D], "disaggregation": {"protocol": "sglang", "decode_order": "best_fit"}}
    )
    assert chosen.disaggregation.order() == "best_fit"
