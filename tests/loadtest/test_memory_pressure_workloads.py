"""The memory-pressure benchmark's workloads: the gateway classes each request as the workload does."""

from __future__ import annotations

import argparse

import pytest

from loadtest.bench.memory_pressure_workloads import add_options, bodies, workload


@pytest.mark.parametrize("name", ["bimodal-low", "trace", "trace-x4"])
def test_the_gateways_long_class_is_the_workloads_long_kind(name: str) -> None:
    p = argparse.ArgumentParser()
    add_options(p)
    p.add_argument("--duration", type=float, default=10.0)
    w = workload(name, p.parse_args([]), seed=12)
    kinds = {r.kind for r in w.requests}
    # Both classes are present: one is protected from the other.
    assert kinds == {"short", "long"}, kinds
    for r, body in zip(w.requests, bodies(w, seed=12), strict=True):
        # The gateway's demand: the prompt (chat framing included) plus the max_tokens sent.
        demand = r.prompt_tokens + body["max_tokens"]
        gateway_class = "long" if demand >= w.long_threshold else "short"
        assert gateway_class == r.kind, (r.prompt_tokens, body["max_tokens"], w.long_threshold)
