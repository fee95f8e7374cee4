"""The llama.cpp benchmark's workload and summary (pure; the run itself needs real servers)."""

from __future__ import annotations

from loadtest.bench.llamacpp import Outcome, RouterRun, build_parser, table, workload


def test_the_workload_is_bimodal_seeded_and_streams_chats() -> None:
    args = build_parser().parse_args(["--requests", "200", "--rate", "2", "--seed", "3"])
    jobs = workload(args)
    assert jobs == workload(args)
    docs = [j for j in jobs if j.kind == "document"]
    assert 0.2 < len(docs) / len(jobs) < 0.4
    assert all(700 <= j.prompt_words <= 1800 for j in docs)
    assert all(60 <= j.prompt_words <= 150 for j in jobs if j.kind == "chat")
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    body = jobs[0].body
    assert body["stream"] is True and body["max_tokens"] == 64
    assert len(body["messages"][1]["content"].split()) == jobs[0].prompt_words


def test_a_stream_cut_by_an_error_event_counts_as_failed() -> None:
    run = RouterRun(
        "r",
        [
            Outcome("chat", True, ttft_s=1.0, tokens=10, prompt_words=100),
            Outcome("document", True, ttft_s=3.0, tokens=20, prompt_words=900),
            Outcome("document", False, "stream error", ttft_s=2.0, tokens=5),
            Outcome("document", False, "HTTP 400", prompt_words=1500),
        ],
        wall_s=10.0,
    )
    s = run.summary()
    assert (s["failed"], s["documents_failed"], s["documents"]) == (2, 2, 3)
    assert s["failures"] == {"stream error": 1, "HTTP 400": 1}
    assert (s["ttft_p50_s"], s["document_ttft_p50_s"]) == (3.0, 3.0)
    # Goodput counts what succeeded only: 2 requests, 30 tokens in 10 s.
    assert (s["goodput_requests_per_s"], s["goodput_tokens_per_s"]) == (0.2, 3.0)
    # And the prompts it served: 1,000 words in 10 s (the failed document's not among them).
    assert s["served_prompt_words_per_s"] == 100.0
    assert "| r | 2/4 | 2/3 | HTTP 400: 1, stream error: 1 |" in table([s])
