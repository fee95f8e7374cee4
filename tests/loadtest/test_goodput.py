"""The memory-pressure benchmark's goodput figures (loadtest.bench.goodput)."""

from __future__ import annotations

import pytest

from loadtest.bench.goodput import Finish, floor, mean_end
from loadtest.workload import Request


def test_the_floor_is_the_request_that_ends_last_on_an_idle_engine() -> None:
    requests = [
        Request(0.0, 10_000, 100),  # 1 s of prefill + 99 tokens at 100/s: ends at 1.99
        Request(0.5, 100, 200),  # 0.01 + 1.99: ends at 2.50
        Request(2.0, 5_000, 2),  # 0.5 + 0.01: ends at 2.51
    ]
    end, last = floor(requests, prefill_tps=10_000, decode_tps=100)
    assert last == 2
    assert end == pytest.approx(2.51)
    # The longest output is not always the last: here the late arrival is.
    assert floor(requests[:2], 10_000, 100) == (pytest.approx(2.5), 1)


def test_a_one_token_answer_is_its_prefill_only() -> None:
    assert floor([Request(1.0, 2_000, 1)], 1_000, 10) == (pytest.approx(3.0), 0)


def test_no_requests_has_no_floor() -> None:
    with pytest.raises(ValueError, match="no requests"):
        floor([], 1_000, 10)


def test_the_mean_end_weighs_each_request_by_its_tokens() -> None:
    assert mean_end([Finish(1.0, 300), Finish(5.0, 100)]) == pytest.approx(2.0)
    assert mean_end([Finish(1.0, 0)]) is None
    assert mean_end([]) is None
