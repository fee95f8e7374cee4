"""The forward projection of paged KV use (proxy.core.projection): peaks, learned output."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.projection import (
    Flight,
    OutputRatios,
    busiest_engine_peak,
    choose_engine,
    projected_peak,
    steps_until_free,
    tokens_freed_within,
)


def test_the_peak_is_reached_before_the_longest_request_ends_not_at_the_sum() -> None:
    # A: 100 now, 10 to come; B: 50 now, 100 to come. Both live for 10 steps: 110 + 60 = 170;
    # then B alone grows to 150. The sum of their worst cases (110 + 150 = 260) never happens.
    flights = [Flight(100, 10, 10), Flight(50, 100, 100)]
    assert projected_peak(flights) == 170


def test_requests_ending_together_peak_at_the_sum_of_their_demands() -> None:
    flights = [Flight(100, 50, 50), Flight(200, 50, 50), Flight(300, 50, 50)]
    assert projected_peak(flights) == 100 + 200 + 300 + 3 * 50


def test_whole_blocks_add_at_most_one_block_per_request() -> None:
    flights = [Flight(100, 50, 50), Flight(200, 50, 50)]
    assert projected_peak(flights, block_size=16) == projected_peak(flights) + 2 * 15


def test_progress_shrinks_nothing_until_requests_end() -> None:
    # Written tokens move from "to come" to "now": the peak stays, the finished part leaves.
    f = Flight(100, 50, 50)
    before = projected_peak([f])
    f.generated = 30
    assert projected_peak([f]) == before
    assert projected_peak([]) == 0


def test_a_request_past_its_expected_length_grows_within_max_tokens() -> None:
    f = Flight(100, max_tokens=1000, expected_output=50, generated=60)
    assert f.remaining == 60  # one more length like the one written so far
    f.generated = 990
    assert f.remaining == 10  # max_tokens bounds it


def test_room_frees_when_enough_requests_end() -> None:
    flights = [Flight(100, 40, 40), Flight(300, 100, 100), Flight(50, 10, 10)]
    # The 10-step one frees 60; with the 40-step one, 200 more.
    assert steps_until_free(flights, 50) == 10
    assert steps_until_free(flights, 200) == 40
    assert steps_until_free(flights, 10_000) == math.inf
    assert steps_until_free(flights, 0) == 0
    assert tokens_freed_within(flights, 40) == 60 + 140


def test_expected_output_is_a_high_quantile_of_the_learned_ratio() -> None:
    ratios = OutputRatios(quantile=0.9, min_samples=10, window=100)
    for i in range(100):
        ratios.observe("model:m", output_tokens=i + 1, max_tokens=100)
    assert ratios.ratio("model:m") == 0.91
    assert ratios.expected(["model:m"], 1000) == 910


@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(-5, 2000)), max_size=300),
    st.integers(1, 40),
    st.floats(0.0, 1.0),
)
def test_the_kept_order_gives_the_quantile_of_the_window_sorted(
    samples: list[tuple[int, int]], window: int, quantile: float
) -> None:
    # The window is kept sorted as samples come and go: it must answer what sorting the
    # window at each question would.
    ratios = OutputRatios(quantile=quantile, min_samples=1, window=window)
    kept: list[float] = []
    for out, most in samples:
        ratios.observe("k", out, most)
        if most > 0:
            kept = [*kept, min(1.0, max(0.0, out / most))][-window:]
        want = sorted(kept)[min(len(kept) - 1, int(quantile * len(kept)))] if kept else None
        assert ratios.ratio("k") == want


def test_too_few_samples_mean_the_worst_case() -> None:
    ratios = OutputRatios(min_samples=5)
    for _ in range(4):
        ratios.observe("model:m", 10, 100)
    assert ratios.expected(["model:m"], 500) == 500
    ratios.observe("model:m", 10, 100)
    assert ratios.expected(["model:m"], 500) == 50


def test_a_client_with_its_own_history_comes_before_the_model() -> None:
    ratios = OutputRatios(quantile=0.5, min_samples=3)
    for _ in range(3):
        ratios.observe("client:a|model:m", 90, 100)
        ratios.observe("model:m", 10, 100)
    assert ratios.expected(["client:a|model:m", "model:m"], 100) == 90
    assert ratios.expected(["client:b|model:m", "model:m"], 100) == 10


def test_the_window_forgets_old_outputs_and_ratios_are_bounded() -> None:
    ratios = OutputRatios(quantile=0.5, min_samples=1, window=3)
    for _ in range(3):
        ratios.observe("k", 100, 100)
    for _ in range(3):
        ratios.observe("k", 10, 100)
    assert ratios.ratio("k") == 0.1
    ratios.observe("k", 500, 100)  # more than max_tokens (a miscount): 1.0 at most
    assert ratios.samples("k") == 3 and max(ratios._ratios["k"]) == 1.0
    ratios.observe("k", 5, 0)  # no max_tokens: nothing learned
    assert ratios.samples("k") == 3


def test_a_data_parallel_nodes_busiest_engine_gets_the_growth_its_usage_shows() -> None:
    # Two engines of 10,000: one holds 9,400 (long documents), the other 4,900 (chats). The
    # flights hold 14,000 now and peak at 31,000: 17,000 still to come. The even split says
    # 15,500 per engine; the busiest engine's share of the growth takes it to ~20,600.
    peak = busiest_engine_peak([9_400, 4_900], now_tokens=14_000, peak=31_000)
    assert peak == math.ceil(9_400 + 17_000 * 9_400 / 14_300)
    assert peak > 31_000 / 2


def test_balanced_or_idle_engines_keep_the_even_split() -> None:
    assert busiest_engine_peak([5_000, 5_000], now_tokens=10_000, peak=16_000) == 8_000
    assert busiest_engine_peak([0, 0], now_tokens=0, peak=3_000) == 1_500
    # Reports that lag behind placements never make it smaller than the even split.
    assert busiest_engine_peak([100, 0], now_tokens=5_000, peak=6_000) == 3_000


def test_a_pinned_engine_is_chosen_by_its_own_flights_peak() -> None:
    # Engine 0 holds a document that will grow to 7,000 tokens; engine 1 three chats that
    # peak near 1,500. A second document (peak 6,000) leaves room only on engine 1, though
    # engine 1 runs more requests (the server's front end, counting requests, picks 0).
    doc = Flight(3_000, 4_000, 4_000, engine=0)
    chats = [Flight(400, 200, 100, engine=1) for _ in range(3)]
    new = Flight(2_000, 4_000, 4_000)
    choice = choose_engine([doc, *chats], new, engine_used=[3_000, 1_200], engine_capacity=10_000)
    assert choice.engine == 1
    assert choice.committed == projected_peak([*chats, new])
    # Without the document engine 0 is empty and has the most room.
    assert choose_engine(chats, new, [0, 1_200], 10_000).engine == 0


def test_flights_of_unknown_engine_count_on_every_engine_and_ties_go_to_fewer_flights() -> None:
    unknown = Flight(5_000, 1_000, 1_000)  # placed while the server chose: could be anywhere
    new = Flight(1_000, 500, 500)
    both = choose_engine([unknown], new, [0, 0], 10_000)
    assert both.committed == projected_peak([unknown, new])  # counted on the chosen one too
    # Equal room: the engine with fewer flights, then the lower rank.
    a = Flight(100, 100, 100, engine=0)
    b = Flight(50, 100, 100, engine=1)
    c = Flight(50, 100, 100, engine=1)
    assert choose_engine([a, b, c], new, [0, 0], 10_000, extra=0).engine == 0
    assert choose_engine([], new, [0, 0, 0], 10_000).engine == 0
    # Usage the flights do not explain (another client) counts against an engine.
    assert choose_engine([], new, [9_000, 0], 10_000).engine == 1


def test_usage_an_engines_flights_do_not_explain_stays_under_its_peak() -> None:
    # Engine 0 holds 3,000 tokens, of which its one flight explains 1,000 (another client,
    # or work ended since the report): the other 2,000 stay while the flights grow.
    mine = Flight(1_000, 500, 500, engine=0)
    new = Flight(1_000, 500, 500)
    choice = choose_engine([mine], new, engine_used=[3_000, 9_000], engine_capacity=10_000)
    assert choice.engine == 0
    assert choice.committed == projected_peak([mine, new]) + 2_000
    # Flights that explain all of it add nothing.
    exact = choose_engine([mine], new, engine_used=[1_000, 9_000], engine_capacity=10_000)
    assert exact.committed == projected_peak([mine, new])


def test_the_extra_reserve_is_added_to_the_chosen_engines_commitment() -> None:
    new = Flight(1_000, 500, 500)
    plain = choose_engine([], new, [0, 0], 10_000)
    assert choose_engine([], new, [0, 0], 10_000, extra=250.5).committed == plain.committed + 251
