"""The memory-pressure benchmark's debug trace (loadtest.bench.memory_pressure_trace)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench.memory_pressure_trace import engine_figures, rises

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.94
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.49
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
"""


def test_each_engine_of_a_node_keeps_its_own_figures() -> None:
    assert engine_figures(METRICS) == {
        "0": {"running": 2.0, "waiting": 1.0, "kv_usage": 0.94, "preemptions": 3.0},
        "1": {"running": 5.0, "kv_usage": 0.49},
    }


def test_a_rise_is_printed_with_the_samples_before_it(tmp_path: Path) -> None:
    def row(t: float, usage: float, count: float) -> str:
        engines = {"0": {"kv_usage": usage, "preemptions": count}}
        return json.dumps({"t": t, "e2": {"engines": engines, "projection": {"peak": 9}}})

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([row(0.0, 0.5, 0), row(0.25, 0.99, 0), row(0.5, 0.6, 1)]))
    lines = rises(path, before=1)
    assert lines[0] == "t=0.5 e2 engine 0: preemptions 1"
    assert len(lines) == 3 and "0.99" in lines[1] and "'peak': 9" in lines[1]
