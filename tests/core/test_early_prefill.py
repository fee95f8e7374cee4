"""The cap on prompt tokens prefill servers hold for requests still waiting for a decode server."""

from __future__ import annotations

from proxy.core.early_prefill import EarlyPrefills


def test_a_server_is_full_once_its_share_would_be_exceeded() -> None:
    holds = EarlyPrefills()
    capacity = {"p1": 2_000, "p2": 2_000}
    assert holds.full(["p1", "p2"], capacity, 1_000, 0.5) == frozenset()
    holds.add("p1", "a", 1_000)
    # p1 holds its whole share: one more token is too many there, p2 still takes it.
    assert holds.full(["p1", "p2"], capacity, 1, 0.5) == {"p1"}
    assert holds.full(["p1", "p2"], capacity, 1_001, 0.5) == {"p1", "p2"}
    # No overlap at all (fraction 0), and a server without a known capacity: full.
    assert holds.full(["p2"], capacity, 1, 0.0) == {"p2"}
    assert holds.full(["p3"], capacity, 1, 0.5) == {"p3"}


def test_release_frees_the_request_everywhere_once() -> None:
    holds = EarlyPrefills()
    holds.add("p1", "a", 300)
    holds.add("p1", "b", 200)
    holds.add("p2", "a", 100)
    assert (holds.tokens("p1"), holds.tokens("p2"), len(holds)) == (500, 100, 3)
    assert sorted(holds.release("a")) == ["p1", "p2"]
    assert (holds.tokens("p1"), holds.tokens("p2"), len(holds)) == (200, 0, 1)
    # Released twice (step 2 sent, then the walk's end): nothing more to free.
    assert holds.release("a") == []
    assert holds.release("b") == ["p1"]
    assert len(holds) == 0 and holds.held == {}


def test_a_share_moves_to_the_server_step_1_landed_on() -> None:
    holds = EarlyPrefills()
    capacity = {"p1": 2_000, "p2": 2_000}
    # Taken on p1 when step 1 was decided: p1 is full for the next one at once.
    holds.add("p1", "a", 1_000)
    assert holds.full(["p1", "p2"], capacity, 1, 0.5) == {"p1"}
    # Step 1 landed on p2: the share goes with it.
    assert sorted(holds.move("a", "p2")) == ["p1", "p2"]
    assert (holds.tokens("p1"), holds.tokens("p2")) == (0, 1_000)
    assert holds.full(["p1", "p2"], capacity, 1, 0.5) == {"p2"}
    assert holds.held == {"p2": {"a": 1_000}}
    # Already there, or never taken (nothing counted): nothing moves.
    assert holds.move("a", "p2") == []
    assert holds.move("b", "p1") == []
    assert holds.held == {"p2": {"a": 1_000}}


def test_a_freed_share_goes_to_the_request_that_waited_longest() -> None:
    holds = EarlyPrefills()
    # Nobody waits: any request may take a share.
    assert holds.turn("new")
    holds.wait("a")
    holds.wait("b")
    holds.wait("a")  # looking again keeps its place
    assert holds.turn("a") and not holds.turn("b") and not holds.turn("new")
    # a takes one (leaves the line): b is next, still before a newcomer.
    holds.add("p1", "a", 100)
    assert holds.turn("b") and not holds.turn("new")
    # b's request ends while it waits: its place goes too.
    holds.release("b")
    assert holds.turn("new") and holds.waiting == {}
