"""Which held two-step requests prefill first, and who takes a prefill server's share.

Pure: a parsed config, a fleet snapshot, the gateway's real book of shares and line of held
requests; no I/O. The end-to-end side (real prefill and decode servers, a share that frees
while two held requests look at it) is ``tests/e2e/test_disaggregation_hold_e2e.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry

from proxy.config import parse_config
from proxy.core.aging import HeldOrder
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView
from proxy.core.two_step import TwoStep
from proxy.gateway.context import RequestContext
from proxy.gateway.early_prefills import EarlyPrefillBook
from proxy.gateway.held_room import nodes_kept
from proxy.gateway.hold_prefill import claim_share, prefill_due, prefill_pending

ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode"}
REPORT = MemoryReport(
    capacity_tokens=100_000, free_tokens=100_000, largest_free_block_tokens=100_000
)
SNAP = FleetSnapshot(tuple(NodeView(n, report=REPORT) for n in ROLES))


def config(**disaggregation: Any) -> Any:
    backends = [
        {"name": n, "url": f"http://127.0.0.1:{9000 + i}", "kind": "vllm", "role": role}
        for i, (n, role) in enumerate(ROLES.items())
    ]
    return parse_config({"backends": backends, "disaggregation": disaggregation}, environ={})


def request(rid: str, prompt: int = 20_000, cfg: Any = None, **two: Any) -> RequestContext:
    """A two-step request as the walk holds it (its step 1 not run unless ``params``)."""
    step = TwoStep(
        body={},
        raw=b"",
        ruled_out=frozenset(),
        prefill_only=frozenset({"p1", "p2"}),
        decode_only=frozenset({"d1"}),
    )
    for name, value in two.items():
        setattr(step, name, value)
    ctx = SimpleNamespace(
        reservation_id=rid,
        prompt_tokens=prompt,
        two_step=step,
        cfg=cfg if cfg is not None else config(),
        snap=SNAP,
    )
    return cast(RequestContext, ctx)


def test_only_a_long_prompt_still_to_compute_over_vllms_protocol_prefills_first() -> None:
    assert prefill_pending(request("doc"))
    # Short (conditional disaggregation sends it straight to a decode server), computed
    # already, or given up on (the decode server computes it): nothing to run first.
    assert not prefill_pending(request("chat", prompt=100))
    assert not prefill_pending(request("done", params={"kv": 1}))
    assert not prefill_pending(request("alone", skipped=True))
    # Mostly cached on a decode server already.
    assert not prefill_pending(request("cached", cached={"d1": 19_900}))
    # SGLang's prefill server computes only once the decode server joined; no early prefills.
    assert not prefill_pending(request("s", cfg=config(protocol="sglang")))
    assert not prefill_pending(request("off", cfg=config(early_prefill_fraction=0.0)))
    # A one-step request.
    one = SimpleNamespace(two_step=None, cfg=config(), prompt_tokens=20_000)
    assert not prefill_pending(cast(RequestContext, one))


def test_while_anything_is_held_a_document_reserves_no_decode_room_before_its_prompt() -> None:
    order = HeldOrder()
    pressure = SimpleNamespace(order=order, enabled=False, flights={})

    def kept(ctx: RequestContext) -> frozenset[str] | None:
        return nodes_kept(cast(Any, pressure), ctx, SNAP, frozenset())

    # Nothing held: it may reserve its decode room first, as before.
    assert kept(request("doc")) == frozenset()
    order.hold("other")
    # Something held: not before its prompt is computed ...
    assert kept(request("doc")) is None
    # ... after which it may.
    assert kept(request("doc", params={"kv": 1})) == frozenset()


def test_a_share_is_taken_when_step_1_is_decided_and_in_the_order_requests_found_none() -> None:
    book = EarlyPrefillBook(CollectorRegistry())
    # A share is half a server: two prompts of 20,000 each on p1 and p2.
    a, b, c, d, e = (request(k) for k in "abcde")
    assert claim_share(book, a, cast(TwoStep, a.two_step)) == frozenset()
    # Taken at once, on the server holding least: b goes to p2 without any await between.
    assert claim_share(book, b, cast(TwoStep, b.two_step)) == frozenset()
    assert (book.holds.tokens("p1"), book.holds.tokens("p2")) == (20_000, 20_000)
    assert claim_share(book, c, cast(TwoStep, c.two_step)) == frozenset()
    assert claim_share(book, d, cast(TwoStep, d.two_step)) == frozenset({"p1"})
    # Every share taken: e waits (in line), and nothing is taken for it.
    assert claim_share(book, e, cast(TwoStep, e.two_step)) is None
    assert not prefill_due(book, e)
    f = request("f")
    assert claim_share(book, f, cast(TwoStep, f.two_step)) is None
    # A share frees: e waited longest, so it is e's, not f's.
    book.release("a")
    assert prefill_due(book, e) and not prefill_due(book, f)
    assert claim_share(book, f, cast(TwoStep, f.two_step)) is None
    assert claim_share(book, e, cast(TwoStep, e.two_step)) == frozenset({"p2"})
    assert book.holds.held["p1"] == {"c": 20_000, "e": 20_000}
    # Step 1 landed elsewhere than the share was taken: the share follows it.
    book.move("e", "p2")
    assert book.holds.tokens("p1") == 20_000 and book.holds.tokens("p2") == 60_000
