"""The simulated engines' mid-stream faults (loadtest/engine/behaviours/faults.py): parsing and counts."""

from __future__ import annotations

import pytest

from loadtest.engine.behaviours.faults import FaultRequestError, MidStreamFault, parse_fault


def test_a_fault_strikes_count_streams_then_none() -> None:
    fault = parse_fault({"mode": "die", "after_tokens": 3, "count": 2})
    assert fault == MidStreamFault("die", 3, 2)
    assert [fault.take() is not None for _ in range(3)] == [True, True, False]
    every = parse_fault({"mode": "stall"})
    assert every is not None and all(every.take() is every for _ in range(5))
    assert parse_fault({"mode": "none"}) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"mode": "explode"}, "mode"),
        ({"mode": "die", "after_tokens": -1}, "after_tokens"),
        ({"mode": "die", "after_tokens": True}, "after_tokens"),
        ({"mode": "die", "count": 0}, "count"),
        ([], "object"),
    ],
)
def test_a_bad_fault_request_names_its_field(body: object, field: str) -> None:
    with pytest.raises(FaultRequestError, match=field):
        parse_fault(body)
