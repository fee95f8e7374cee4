"""Every decode placement that holds back nothing that fits (loadtest.lab.pd_online).

Small lists whose schedules are worked out by hand, and a search that must agree with trying
every choice one by one.
"""

from __future__ import annotations

import itertools
import random

import pytest

from loadtest.lab.pd_floor import DecodeFleet
from loadtest.lab.pd_online import best_placement, main, simulate
from loadtest.workload import Request

# Two servers of 1,000 tokens, 100 tokens a second per request.
TWO = DecodeFleet(servers=2, capacity_tokens=1_000, decode_tps=100.0)


def doc(arrival_s: float, prompt: int, output: int) -> Request:
    return Request(arrival_s, prompt, output, kind="long")


def test_spreading_leaves_no_server_empty_for_the_big_one_and_packing_does() -> None:
    # Two small documents, then one that needs a whole server (900 + 100). Spread puts the
    # second beside nobody, so the big one waits for the first to end (at 2.0 s: 1.8 s).
    # Packed beside the first (together at most 990 tokens, the first ending first), the
    # other server stays empty: no wait.
    requests = [doc(0.0, 300, 200), doc(0.1, 300, 200), doc(0.2, 900, 100)]
    assert simulate(requests, TWO).longest_wait_s == pytest.approx(1.8)
    assert simulate(requests, TWO, default=-1).longest_wait_s == 0.0
    found = best_placement(requests, TWO)
    assert found.best_s == 0.0 and found.complete
    assert found.best_choices == (1,)


def test_a_server_never_takes_what_would_outgrow_it() -> None:
    # One server: the second document would grow past 1,000 beside the first; it waits for
    # the first's end (5 s), though its prompt fits at once.
    one = DecodeFleet(servers=1, capacity_tokens=1_000, decode_tps=100.0)
    requests = [doc(0.0, 400, 500), doc(1.0, 100, 400)]
    assert simulate(requests, one).longest_wait_s == pytest.approx(4.0)


def test_a_request_no_empty_server_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="no schedule serves it"):
        simulate([doc(0.0, 900, 200)], TWO)


@pytest.mark.parametrize("seed", range(12))
def test_the_search_agrees_with_trying_every_choice(seed: int) -> None:
    # Crowded lists (most wait; in several the choices change the longest wait).
    rng = random.Random(seed)
    requests = sorted(
        (
            Request(
                round(rng.uniform(0, 2), 2),
                rng.randint(100, 600),
                rng.randint(50, 300),
                kind=rng.choice(["long", "long", "short"]),
            )
            for _ in range(rng.randint(5, 9))
        ),
        key=lambda r: r.arrival_s,
    )
    docs = sum(1 for r in requests if r.kind == "long")
    every = min(
        w
        for choices in itertools.product((0, 1), repeat=docs)
        if (w := simulate(requests, TWO, choices).longest_wait_s) is not None
    )
    found = best_placement(requests, TWO)
    assert found.complete
    assert found.best_s == pytest.approx(every)
    # The choices it reports give that wait.
    assert simulate(requests, TWO, found.best_choices).longest_wait_s == pytest.approx(every)


def test_the_command_prints_a_row_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--duration", "2", "--rate", "2", "--seeds", "7,8"]) == 0
    rows = [
        ln
        for ln in capsys.readouterr().out.splitlines()
        if ln.startswith("| 7 |") or ln.startswith("| 8 |")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        spread, best_fit, best = (float(c) for c in cells[3:6])
        assert 0.0 <= best <= min(spread, best_fit), row
