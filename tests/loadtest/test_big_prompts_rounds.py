"""``big_prompts.rounds``: the targets' order alternates, and the ratio to vllm-router is
taken round by round (pure logic: the points are made up)."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.bench import big_prompts
from loadtest.bench.overhead_targets import Target


def test_rounds_alternate_the_order_and_pair_each_round_with_the_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    # Round by round the box slows down for everyone: the ratio stays 0.5 in each.
    rates = {"vllm-router": [1000.0, 500.0, 250.0], "kvroute": [500.0, 250.0, 125.0]}

    def point(target: Target, run: Any) -> dict[str, Any]:
        order.append(target.name)
        rps = rates[target.name][sum(1 for n in order if n == target.name) - 1]
        return {"target": target.name, "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0,
                "requests": 10, "errors": 0, "cpu_ms_per_req": 0.1}  # fmt: skip

    monkeypatch.setattr(big_prompts, "point", point)
    targets = [Target("vllm-router", "u1"), Target("kvroute", "u2")]
    router, kv = big_prompts.rounds(targets, None, 3)
    assert order == ["vllm-router", "kvroute", "kvroute", "vllm-router", "vllm-router", "kvroute"]
    # The medians of each column would say 250 / 500 = 0.5 too; the rounds say it each time.
    assert kv["x_router"] == 0.5 and router["x_router"] == 1.0
    assert kv["rps"] == 250.0 and kv["requests"] == 30 and kv["rounds_rps"] == [500, 250, 125]


def test_one_round_is_the_point_itself() -> None:
    point = {"target": "kvroute", "rps": 300.0, "p50_ms": 1.0, "p99_ms": 2.0,
             "requests": 10, "errors": 0, "cpu_ms_per_req": 0.1}  # fmt: skip
    router = [{**point, "target": "vllm-router", "rps": 1000.0}]
    row = big_prompts.summary([point], router)
    assert row["x_router"] == 0.3 and "rounds_rps" not in row
    assert big_prompts.summary([point], None).get("x_router") is None
