"""Workload generators, trace reading and prompt text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtest.workload import (
    WORDS,
    MixClass,
    Request,
    bimodal,
    load_trace,
    make_prompt,
    parametric,
    summary,
    write_jsonl,
)
from proxy.core.tokens import count_text

TRACE = (
    Path(__file__).resolve().parents[2] / "loadtest" / "data" / "AzureLLMInferenceTrace_code.csv"
)


def test_bimodal_mix_matches_problem_statement() -> None:
    reqs = bimodal(5.0, n=20_000, seed=11)
    assert len(reqs) == 20_000
    short = [r for r in reqs if r.kind == "short"]
    long_ = [r for r in reqs if r.kind == "long"]
    assert 0.68 < len(short) / len(reqs) < 0.72
    assert all(20 <= r.prompt_tokens <= 500 for r in short)
    assert all(15_000 <= r.prompt_tokens <= 30_000 for r in long_)
    assert all(r.output_tokens >= 1 for r in reqs)
    # Poisson arrivals: increasing times, mean gap close to 1/rate.
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] > 0
    mean_gap = times[-1] / len(times)
    assert 0.19 < mean_gap < 0.21


def test_bimodal_is_seeded_and_duration_bounded() -> None:
    assert bimodal(2.0, n=50, seed=3) == bimodal(2.0, n=50, seed=3)
    assert bimodal(2.0, n=50, seed=3) != bimodal(2.0, n=50, seed=4)
    reqs = bimodal(10.0, duration_s=30.0, seed=1)
    assert reqs and reqs[-1].arrival_s <= 30.0
    assert 200 < len(reqs) < 400
    assert len(bimodal(10.0, n=5, duration_s=1_000.0)) == 5


def test_parametric_and_bad_arguments() -> None:
    classes = [
        MixClass("short", 1.0, (10, 10), (5, 5)),
        MixClass("long", 3.0, (9_000, 9_000), (7, 7)),
    ]
    reqs = parametric(1.0, classes, n=4_000, seed=2)
    long_share = sum(r.kind == "long" for r in reqs) / len(reqs)
    assert 0.72 < long_share < 0.78
    assert {(r.prompt_tokens, r.output_tokens) for r in reqs} == {(10, 5), (9_000, 7)}
    assert Request(0.0, 10, 5).total_tokens == 15
    with pytest.raises(ValueError):
        parametric(1.0, classes)  # neither n nor duration
    with pytest.raises(ValueError):
        bimodal(0.0, n=1)
    with pytest.raises(ValueError):
        bimodal(1.0, n=1, short=(500, 20))
    with pytest.raises(ValueError):
        bimodal(1.0, n=1, short_share=1.5)


def test_reads_the_azure_trace() -> None:
    reqs = load_trace(TRACE)
    assert len(reqs) == 8_819
    assert reqs[0] == Request(0.0, 4_808, 10, "short")
    assert reqs[-1].arrival_s == pytest.approx(3_435.948056, abs=1e-4)
    assert (reqs[-1].prompt_tokens, reqs[-1].output_tokens) == (549, 173)
    assert sum(r.prompt_tokens for r in reqs) == 18_059_974
    assert sum(r.output_tokens for r in reqs) == 245_896
    assert max(r.prompt_tokens for r in reqs) == 7_437
    assert all(r.kind == "short" for r in reqs)  # nothing reaches 8,000 tokens unscaled

    scaled = load_trace(TRACE, length_scale=4.0, rate_scale=2.0, limit=100)
    assert len(scaled) == 100
    assert scaled[1].arrival_s == pytest.approx(reqs[1].arrival_s / 2)
    assert scaled[0].prompt_tokens == 4 * 4_808 and scaled[0].kind == "long"
    assert scaled[2].prompt_tokens == 4 * 110 and scaled[2].kind == "short"


def test_jsonl_round_trip(tmp_path: Path) -> None:
    reqs = bimodal(3.0, n=25, seed=5)
    path = tmp_path / "w.jsonl"
    write_jsonl(reqs, path)
    back = load_trace(path)
    assert [(r.prompt_tokens, r.output_tokens, r.kind) for r in back] == [
        (r.prompt_tokens, r.output_tokens, r.kind) for r in reqs
    ]
    assert back[0].arrival_s == 0.0
    assert back[-1].arrival_s == pytest.approx(reqs[-1].arrival_s - reqs[0].arrival_s)


def test_bad_trace_files(tmp_path: Path) -> None:
    bad_csv = tmp_path / "t.csv"
    bad_csv.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        load_trace(bad_csv)
    bad_row = tmp_path / "r.csv"
    bad_row.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,x,1\r\n"
    )
    with pytest.raises(ValueError, match=":2:"):
        load_trace(bad_row)
    bad_jsonl = tmp_path / "t.jsonl"
    bad_jsonl.write_text('{"arrival_s": 0, "prompt_tokens": 3}\n')
    with pytest.raises(ValueError, match=":1:"):
        load_trace(bad_jsonl)


@pytest.mark.parametrize("n", [0, 1, 2, 17, 500, 30_000])
def test_make_prompt_has_exact_token_count(n: int) -> None:
    text = make_prompt(n, random.Random(n))
    assert count_text(text) == n


def test_make_prompt_words_are_single_tokens() -> None:
    assert all(count_text(" " + w) == 1 and count_text(w) == 1 for w in WORDS)
    assert make_prompt(50, random.Random(1)) == make_prompt(50, random.Random(1))


def test_summary() -> None:
    s = summary([Request(0.0, 100, 10, "short"), Request(2.0, 20_000, 30, "long")])
    assert s["n"] == 2 and s["long_share"] == 0.5 and s["mean_prompt"] == 10_050
    assert s["rate_per_s"] == 0.5
    assert summary([])["n"] == 0
