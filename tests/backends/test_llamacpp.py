"""llama.cpp's pages -> MemoryReport, its /v1/models and its errors (pure; captured pages)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from proxy.backends.llamacpp import (
    PROPS_PATH,
    SLOTS_PATH,
    Slot,
    classify,
    parse_models,
    parse_slots,
)
from proxy.backends.parse import pages_for, parse_report
from proxy.backends.samples import ScrapeError
from proxy.core.fleet import NodeView, Overlay, classify_failure

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
NOW = 1000.0
IDLE_METRICS = "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"


def raw(name: str) -> bytes:
    return (DATA / name).read_bytes()


def slots_body(*slots: dict[str, object]) -> bytes:
    return orjson.dumps([{"id": i, **s} for i, s in enumerate(slots)])


def busy(n_ctx: int, prompt: int, n_predict: int, decoded: int = 0) -> dict[str, object]:
    return {
        "n_ctx": n_ctx,
        "is_processing": True,
        "n_prompt_tokens": prompt,
        "params": {"n_predict": n_predict},
        "next_token": [{"n_decoded": decoded, "n_remain": n_predict - decoded}],
    }


def props_body(slots: int, n_ctx: int) -> bytes:
    return orjson.dumps({"total_slots": slots, "default_generation_settings": {"n_ctx": n_ctx}})


def report(props: bytes, slots: bytes, layout: str, metrics: str = IDLE_METRICS):  # type: ignore[no-untyped-def]
    pages = {PROPS_PATH: props, SLOTS_PATH: slots}
    return parse_report("llamacpp", metrics, NOW, None, pages, layout)  # type: ignore[arg-type]


def test_the_scrape_reads_props_and_slots_only_for_llamacpp() -> None:
    assert pages_for("llamacpp") == ("/slots", "/props")
    assert pages_for("vllm") == ()


def test_captured_unified_pool_counts_busy_slots_at_prompt_plus_max_tokens() -> None:
    r = report(
        raw("unified-props.json"),
        raw("unified-slots-busy.json"),
        "unified",
        raw("unified-metrics-busy.txt").decode(),
    )
    # 1057 + 300 and 1058 + 40 held or to come: more than the 2,048-cell pool.
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (2048, 0, 0)
    assert (r.running, r.waiting, r.allocator, r.queueing) == (2, 0, "contiguous", False)
    assert r.reported_at == NOW


def test_captured_partitioned_idle_server_offers_one_slot() -> None:
    r = report(raw("partitioned-props.json"), raw("partitioned-slots-idle.json"), "partitioned")
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (4096, 4096, 2048)


def test_unified_free_is_the_pool_less_what_busy_slots_will_grow_to() -> None:
    slots = slots_body(busy(2048, 900, 300, decoded=120), {"n_ctx": 2048, "is_processing": False})
    r = report(props_body(2, 2048), slots, "unified")
    assert (r.free_tokens, r.largest_free_block_tokens) == (2048 - 1200, 848)


def test_a_request_without_max_tokens_may_grow_to_the_whole_slot() -> None:
    assert Slot(2048, True, 100, 5, -1).holds() == 2048
    # Decoded past its stated max (never: the server stops) still counts what it holds.
    assert Slot(2048, True, 100, 50, 10).holds() == 150
    assert Slot(2048, True, 2000, 0, 300).holds() == 2048


def test_partitioned_largest_block_is_the_largest_idle_slot_and_the_rest_is_fragmentation() -> None:
    slots = slots_body(busy(1024, 100, 50), {"n_ctx": 1024, "is_processing": False})
    r = report(props_body(2, 1024), slots, "partitioned")
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (2048, 1898, 1024)
    # 1,500 tokens would fit the free cells, not a slot: a partition's false exhaustion.
    assert classify_failure(1500, r.free_tokens) == "fragmentation"


@pytest.mark.parametrize("layout", ["unified", "partitioned"])
def test_no_idle_slot_or_deferred_requests_means_nothing_fits_now(layout: str) -> None:
    full = slots_body(busy(2048, 10, 10), busy(2048, 10, 10))
    r = report(props_body(2, 2048), full, layout)
    # Full, not fragmented: no free cells shown where no request could use them.
    assert (r.free_tokens, r.largest_free_block_tokens, r.fragmentation) == (0, 0, 0.0)
    idle = slots_body(busy(2048, 10, 10), {"n_ctx": 2048, "is_processing": False})
    deferred = "llamacpp:requests_deferred 3\n"
    r = report(props_body(2, 2048), idle, layout, deferred)
    assert (r.largest_free_block_tokens, r.waiting) == (0, 3)


def test_slots_and_props_must_agree() -> None:
    with pytest.raises(ScrapeError, match="lists 1 slots"):
        report(props_body(2, 2048), slots_body({"n_ctx": 2048, "is_processing": False}), "unified")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>", "not JSON"),
        (b"[]", "not a list of slots"),
        (b'[{"n_ctx": "x"}]', "not an integer"),
        (
            b'{"error": {"code": 501, "message": "This server does not support slots endpoint."}}',
            "--slots",
        ),
    ],
)
def test_bad_slots_pages_are_scrape_errors(body: bytes, match: str) -> None:
    with pytest.raises(ScrapeError, match=match):
        parse_slots(body)


def test_metrics_alone_is_not_enough() -> None:
    with pytest.raises(ScrapeError, match="/props and /slots"):
        parse_report("llamacpp", IDLE_METRICS, NOW)


def test_models_limit_is_one_slot() -> None:
    info = parse_models(raw("models.json"))
    assert info.ids == ("/models/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert info.max_model_len() == 2048


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            500,
            b'{"error":{"code":500,"message":"Context size has been exceeded.",'
            b'"type":"server_error"}}',
            "allocation",
        ),
        (
            400,
            b'{"error":{"code":400,"message":"request (6394 tokens) exceeds the available '
            b'context size (2048 tokens), try increasing it","type":"exceed_context_size_error",'
            b'"n_prompt_tokens":6394,"n_ctx":2048}}',
            "allocation",
        ),
        (
            400,
            b'{"error":{"code":400,"message":"\'messages\' is required",'
            b'"type":"invalid_request_error"}}',
            "client_error",
        ),
        (
            503,
            b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
            "overload",
        ),
        (500, b'{"error":{"code":500,"message":"boom","type":"server_error"}}', "server_error"),
    ],
)
def test_context_failures_are_this_nodes_capacity(status: int, body: bytes, expected: str) -> None:
    assert classify(status, body) == expected


def test_a_unified_pool_counts_the_gateways_flights_that_slots_do_not_show_yet() -> None:
    idle = slots_body(*({"n_ctx": 2048, "is_processing": False} for _ in range(4)))
    unified = report(props_body(4, 2048), idle, "unified")
    assert unified.counts_flights
    # 1,500 tokens reserved there before this report, not yet in /slots (the server has not
    # read the request yet): the contiguous rule alone would offer the whole pool.
    sent = Overlay(reserved_tokens=1500, inflight=1)
    assert NodeView("u", report=unified, overlay=sent).usable_block() == 548
    # Once /slots shows it, it is not counted twice.
    shown = report(
        props_body(4, 2048),
        slots_body(
            busy(2048, 1400, 100), *({"n_ctx": 2048, "is_processing": False} for _ in range(3))
        ),
        "unified",
    )
    assert NodeView("u", report=shown, overlay=sent).usable_block() == 548
    # Partitioned slots: still one idle slot's worth, within all the cells less the flights.
    partitioned = report(props_body(4, 2048), idle, "partitioned")
    assert NodeView("p", report=partitioned, overlay=sent).usable_block() == 2048
    crowded = Overlay(reserved_tokens=7000, inflight=9)
    assert NodeView("p", report=partitioned, overlay=crowded).usable_block() == 1192


def test_partitioned_slots_queue_what_one_slot_holds_a_unified_pool_nothing() -> None:
    full = slots_body(busy(1024, 300, 64), busy(1024, 900, 64))
    deferred = "llamacpp:requests_deferred 2\n"
    split = report(props_body(2, 1024), full, "partitioned", deferred)
    # No room now, yet the server defers a request one slot holds and starts it when a slot
    # frees: it waits there, it never fails for room.
    assert (split.largest_free_block_tokens, split.waiting) == (0, 2)
    assert (split.queued_up_to_tokens, split.max_num_seqs) == (1024, 2)
    # A unified pool's deferred request may overfill the shared cells when it starts.
    pool = report(props_body(2, 1024), full, "unified", deferred)
    assert (pool.queued_up_to_tokens, pool.max_num_seqs) == (0, 2)
    # An operator's smaller capacity bounds it too.
    pages = {PROPS_PATH: props_body(2, 1024), SLOTS_PATH: full}
    capped = parse_report("llamacpp", deferred, NOW, 800, pages, "partitioned")
    assert capped.queued_up_to_tokens == 800


def test_a_partitioned_server_with_every_slot_busy_takes_what_one_slot_holds() -> None:
    full = slots_body(busy(1024, 300, 64), busy(1024, 900, 64))
    split = report(props_body(2, 1024), full, "partitioned")
    node = NodeView("p", report=split, overlay=Overlay(reserved_tokens=1500, inflight=2))
    assert node.usable_block() == 0 and not node.fits_now(100, NOW)
    assert node.fits(1024, NOW) and node.fits(1000, NOW, safety_margin=0.02)
    # Larger than a slot: the server's 400, so never sent where no slot holds it.
    assert not node.fits(1025, NOW) and not node.fits(1010, NOW, safety_margin=0.02)
    # A learned ceiling still refuses (a context failure there).
    failed = Overlay(reserved_tokens=1500, inflight=2, ceiling_tokens=800, ceiling_until=NOW + 5)
    assert not NodeView("p", report=split, overlay=failed).fits(900, NOW)
    pool = report(props_body(2, 1024), full, "unified")
    assert not NodeView("u", report=pool).fits(100, NOW)
