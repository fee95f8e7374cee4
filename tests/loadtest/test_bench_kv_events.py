"""Smoke run of the KV-events benchmark with tiny parameters, so it never rots (no speed asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.loadtest.test_bench_scripts import run_module

pytestmark = pytest.mark.timeout(150)


def test_bench_kv_events_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    run_module(
        "loadtest.bench.kv_events",
        "--requests", "16", "--scenarios", "bypass", "--targets", "kvroute",
        "--json", str(out),
        timeout=140,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["scenario"], r["target"]) for r in rows] == [
        ("bypass", "kvroute + events"),
        ("bypass", "kvroute approximate"),
    ]
    for r in rows:
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert set(r) >= {"hit_rate", "routed_hit_rate", "doc_p50_ms", "doc_p99_ms"}


def test_usage_of_reads_the_final_usage_chunk_and_nothing_without_one() -> None:
    from loadtest.bench.kv_events_measure import usage_of

    tail = (
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3200,"completion_tokens":5,'
        b'"prompt_tokens_details":{"cached_tokens":3184}}}\n\ndata: [DONE]\n\n'
    )
    assert usage_of(tail) == (3200, 3184)
    assert usage_of(b'data: {"usage":{"prompt_tokens":12}}\n\n') == (0, 0)
    assert usage_of(b"") == (0, 0)
