"""llama.cpp's partitioned slots are split by configuration: no restart advice for them,
and a layout advice where a request was too long for any slot."""

from __future__ import annotations

from proxy.backends.llamacpp import PROPS_PATH, SLOTS_PATH
from proxy.backends.parse import parse_report
from proxy.config import MaintenanceConfig, parse_config
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.ops.advice import advise
from proxy.ops.diagnosis import Failure
from proxy.ops.maintenance import partitioned_slots
from proxy.ops.node_advice import update_below_since
from proxy.ops.slot_advice import slot_layout_advice

NOW = 1_000_000.0
CFG = MaintenanceConfig(restart_after_s=300, min_interval_per_node_s=0)


def idle_partitioned(name: str) -> NodeView:
    """An idle llama-server with four slots of 1,024: free 4,096, the largest block 1,024."""
    slots = b"[" + b",".join(b'{"id":%d,"n_ctx":1024,"is_processing":false}' % i for i in range(4))
    pages = {
        PROPS_PATH: b'{"total_slots":4,"default_generation_settings":{"n_ctx":1024}}',
        SLOTS_PATH: slots + b"]",
    }
    text = "llamacpp:requests_deferred 0\n"
    report = parse_report("llamacpp", text, NOW, None, pages, "partitioned")
    return NodeView(name=name, report=report)


def test_partitioned_llamacpp_backends_are_named_from_the_config() -> None:
    backends = [
        {"name": "p", "url": "http://127.0.0.1:1", "kind": "llamacpp", "kv_layout": "partitioned"},
        {"name": "u", "url": "http://127.0.0.1:2", "kind": "llamacpp"},
        {"name": "v", "url": "http://127.0.0.1:3", "kind": "vllm"},
    ]
    assert partitioned_slots(parse_config({"backends": backends}, "t", environ={})) == {"p"}


def test_an_idle_partitioned_server_is_never_a_restart_candidate() -> None:
    snap = FleetSnapshot((idle_partitioned("p"),), taken_at=NOW)
    assert snap.nodes[0].report is not None and snap.nodes[0].report.largest_block_ratio == 0.25
    # Read as any contiguous allocator, its slots look like a checkerboard: restart advice.
    since = update_below_since({}, snap, NOW - 600, CFG)
    assert since == {"p": NOW - 600}
    blind = advise(snap, NOW, CFG, stale_after_s=10, below_since=since)
    assert blind.action == "restart"
    # Split by its configuration, it is left out: no restart joins its slots.
    since = update_below_since({}, snap, NOW - 600, CFG, split_by_config={"p"})
    assert since == {}
    assert advise(snap, NOW, CFG, stale_after_s=10, below_since=since).action == "none"


def test_a_request_too_long_for_any_slot_is_not_restart_advice_but_a_layout_one() -> None:
    """2,000 tokens failed on a server of four 1,024-token slots: 4,096 free in total, so
    the failure reads as fragmentation, and a restart would start the same four slots."""
    snap = FleetSnapshot((idle_partitioned("p"),), taken_at=NOW)
    failed = Failure(NOW - 5, "p", "fragmentation", 2_000, 1.0, True, ("p",))
    blind = advise(snap, NOW, CFG, stale_after_s=10, failures=[failed])
    assert blind.action == "restart" and blind.nodes[0].restart_reasons == ("failures",)
    told = advise(snap, NOW, CFG, stale_after_s=10, failures=[failed], split_by_config={"p"})
    assert told.action == "none" and told.nodes[0].restart_reasons == ()
    layout = slot_layout_advice({"p"}, [failed], snap)
    assert layout["servers"] == {
        "p": {
            "failed_demand_tokens": 2_000,
            "context_tokens": 4_096,
            "largest_idle_slot_tokens": 1_024,
        }
    }
    assert "2000 tokens" in layout["reason"] and "--kv-unified" in layout["reason"]
    # A unified server's failures are someone else's business (fragmentation or capacity).
    assert slot_layout_advice(set(), [failed], snap)["servers"] == {}
