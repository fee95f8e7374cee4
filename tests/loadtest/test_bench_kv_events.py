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


def _chat(system: str, question: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def test_ceiling_counts_only_blocks_an_earlier_prompt_sent() -> None:
    from loadtest.bench.kv_events_measure import ceiling
    from loadtest.engine.behaviours.prefix_cache import prompt_block_hashes, prompt_ids

    doc = " ".join(f"word{i}" for i in range(600))
    first, again, other = _chat(doc, "first?"), _chat(doc, "again?"), _chat("hello", "hi")
    n = [len(prompt_ids(b)) for b in (first, again, other)]
    # The blocks the second prompt shares with the first: the document's full blocks.
    shared = 0
    for a, b in zip(prompt_block_hashes(first, 16), prompt_block_hashes(again, 16), strict=False):
        if a != b:
            break
        shared += 1
    assert shared > 10
    got = ceiling([first, again, other], [True, True, True], 16)
    assert got.all == pytest.approx(shared * 16 / sum(n))
    assert got.routed == got.all
    # The same prompt twice: everything but its last token, the second time.
    twice = ceiling([first, first], [True, True], 16)
    assert twice.all == pytest.approx((n[0] - 1) / (2 * n[0]), abs=16 / n[0])


def test_ceiling_of_routed_requests_counts_blocks_a_bypassed_one_sent() -> None:
    from loadtest.bench.kv_events_measure import ceiling

    doc = " ".join(f"word{i}" for i in range(600))
    first, again = _chat(doc, "first?"), _chat(doc, "again?")
    # The first went past the router: the routed one can still find its blocks.
    got = ceiling([first, again], [False, True], 16)
    assert got.routed > 0.9
    assert got.all < got.routed
    assert ceiling([first, again], [True, False], 16).routed == 0.0


def test_ratios_compare_events_with_approximate_and_flag_a_need_above_the_ceiling() -> None:
    from loadtest.bench.kv_events_measure import Row, ratios

    def row(target: str, hit: float, routed: float) -> Row:
        return Row(
            "bypass", target, hit_rate=hit, routed_hit_rate=routed, ceiling=0.64, routed_ceiling=0.6
        )

    out = ratios(
        [
            row("kvroute + events", 0.5, 0.55),
            row("kvroute approximate", 0.4, 0.5),
            row("vllm-router cache_aware", 0.45, 0.5),
        ]
    ).splitlines()
    assert len(out) == 3  # the head, its rule, one line: only events against approximate
    # 1.25 x 0.4 = 50% fits under 64%; 1.25 x 0.5 = 62.5% does not fit under 60%.
    assert out[2] == "| bypass | 1 | 1.25x | 1.10x | 50.0% | 62.5% > ceiling | 64.0% | 60.0% |"
