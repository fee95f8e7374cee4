"""Break the code on purpose, one small realistic change at a time, and check a test notices.

Each mutation names the function it breaks (``anchor``: a function or ``Class.method``,
optionally ``module:`` in front when the name alone is ambiguous, found by parsing every
``proxy/**/*.py``) and a short pattern inside that function's source. Both are names that
refactors keep, so a mutation survives files being moved, split or renamed; when the anchor or
the pattern no longer resolves to exactly one place, the row is **stale** and the run fails:
a mutation that tests nothing must be fixed, not skipped. ``tests/test_mutations_fresh.py``
checks every row resolves (and that its guards exist) on every test run.

The patch goes to a temporary copy of the working tree and the guard tests run there. A
mutation is *caught* when those tests fail, *missed* when they pass. Rows with no patch are
properties today's code does not have yet: their guard is an ``xfail(strict=True)`` test, run
here with ``--runxfail``, and "caught" means it fails today.

    python tests/mutations/run.py              # every mutation, a table at the end (~15 min)
    python tests/mutations/run.py --ci         # the fast subset .ci/run runs (~1-2 min)
    python tests/mutations/run.py --check      # only resolve every row (no tests run)
    python tests/mutations/run.py --list
    python tests/mutations/run.py --only admission --baseline

(Not collected by pytest: the file is not named ``test_*.py``.)
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    guards: tuple[str, ...]
    #: the function the patch goes into: ``name``, ``Class.method`` or ``outer.inner``, with
    #: ``module:`` in front (the module's own name, e.g. ``vllm:report``) when ambiguous
    anchor: str | None = None
    #: regex (MULTILINE) that must match exactly once inside the anchor's source
    pattern: str | None = None
    replacement: str = ""
    #: in the CI subset (``--ci``): guards that run in seconds
    fast: bool = False


POLICY_PROPERTIES = (
    "tests/routing/test_policy.py::test_every_ranked_node_is_eligible_and_kvroute_ranks_only_fitting_nodes",
    "tests/routing/test_policy.py::test_kvroute_ranks_exactly_the_nodes_that_hold_the_request_at_the_edge",
)
NO_RESERVATION_LEFT = (
    "tests/api/test_fuzz.py::test_fuzz_left_no_reservation",
    "tests/e2e/test_gateway_e2e.py::test_redis_store_used_by_gateway_leaves_no_reservations",
    "tests/faults/test_fault_suite.py::test_fault_baseline",
)
LEDGER_RETRY = "tests/gateway/test_ledger_and_cache.py::test_a_release_that_fails_is_queued_and_retried_until_it_lands"
NO_REPORT_RANKING = "tests/routing/test_policy.py::test_nodes_without_a_report_go_by_length_and_spread_by_what_is_in_flight"
DP_CAPACITY = "tests/backends/test_vllm_data_parallel.py"
KV_INDEX = "tests/core/test_kv_events_index.py"
LIMITS_BOTH_PATHS = "tests/api/test_lean_path.py::test_bad_input_is_answered_alike_on_both_paths"

MUTATIONS: tuple[Mutation, ...] = (
    # ---- every exit path releases the reservation
    Mutation(
        "leak-whole-answer",
        "no release after a successful non-streamed answer",
        NO_RESERVATION_LEFT,
        "whole_answer",
        r"^(\s*)gw\.tasks\.release_later\(ctx, backend\)$",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "leak-stream-close",
        "no release when a stream closes",
        NO_RESERVATION_LEFT,
        "StreamRelay.close",
        r"self\.gw\.tasks\.release_later\(self\.ctx, self\.backend\)",
        "pass  # MUTATION",
    ),
    Mutation(
        "leak-divert",
        "no release when an attempt fails before the first byte and the request moves on",
        ("tests/faults/test_fault_suite.py::test_fault_backend_misbehaves",),
        "divert",
        r"^(\s*)gw\.tasks\.release_later\(ctx, backend\)$",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "leak-attempt-interrupted",
        "no release when an attempt is interrupted (the client left, a cancel)",
        (
            "tests/faults/test_fault_gateway_causes.py::test_fault_client_leaves_a_non_streamed_request",
        ),
        "send_attempt",
        r"^(\s*)gw\.tasks\.release_later\(ctx, backend\)\n(\s*)raise$",
        r"\1pass  # MUTATION\n\2raise",
    ),
    Mutation(
        "leak-continuation",
        "no release of the broken part's reservation when a stream is continued elsewhere",
        ("tests/gateway/test_continuation_e2e.py",),
        "StreamRelay.drop_part",
        r"self\.gw\.tasks\.release_later\(self\.ctx, self\.backend\)",
        "pass  # MUTATION",
    ),
    Mutation(
        "release-not-queued",
        "a failed release is not queued for retry",
        (LEDGER_RETRY + "[awaited]",),
        "ReservationLedger._release_settled",
        r"self\.pending\[key\] = self\.clock\(\) \+ self\.ttl_s",
        "pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "batched-release-not-queued",
        "a failed batch of releases is not queued for retry",
        (LEDGER_RETRY + "[batched]",),
        "ReservationLedger._send_batch",
        r"self\.pending\[key\] = give_up",
        "pass  # MUTATION",
        fast=True,
    ),
    # ---- fit and pending reservations (NodeView: one home for each)
    Mutation(
        "fit-ignores-margin",
        "NodeView.fits ignores the safety margin",
        POLICY_PROPERTIES,
        "NodeView._need",
        r"need = demand \* \(1\.0 \+ safety_margin\)",
        "need = float(demand)",
        fast=True,
    ),
    Mutation(
        "fit-ignores-blocks",
        "NodeView.fits ignores whole blocks on a paged allocator",
        POLICY_PROPERTIES,
        "NodeView._need",
        r"need = self\.report\.whole_blocks\(need\)",
        "pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "fit-ceiling-off-by-one",
        "a learned ceiling refuses only sizes above it, not the size that failed",
        POLICY_PROPERTIES,
        "NodeView._need",
        r"demand >= \(self\.overlay\.ceiling_tokens or 0\)",
        "demand > (self.overlay.ceiling_tokens or 0)",
        fast=True,
    ),
    Mutation(
        "pending-ignored",
        "the largest block ignores reservations made after the report",
        (*POLICY_PROPERTIES, "tests/routing/test_nothing_fits.py"),
        "NodeView.usable_block",
        r"self\.report\.largest_free_block_tokens - self\.overlay\.pending_tokens",
        "self.report.largest_free_block_tokens",
        fast=True,
    ),
    Mutation(
        "pending-ignored-in-free",
        "free memory ignores reservations made after the report",
        ("tests/routing/test_nothing_fits.py",),
        "NodeView.usable_free",
        r"self\.report\.free_tokens - self\.overlay\.pending_tokens",
        "self.report.free_tokens",
        fast=True,
    ),
    Mutation(
        "lazy-ignores-inflight",
        "a lazily allocating node's headroom ignores what is in flight at full demand",
        ("tests/core/test_lazy.py",),
        "NodeView.usable_block",
        r"return lazy_headroom\(self\.report, self\.overlay\.reserved_tokens\)",
        "return lazy_headroom(self.report, 0)",
        fast=True,
    ),
    Mutation(
        "projected-room-asks-free-now",
        "a projected lazily allocating node still asks the new request's whole demand of the KV free now",
        (
            "tests/core/test_lazy.py::test_a_projected_node_needs_room_for_the_peak_not_the_whole_demand_now",
        ),
        "NodeView.usable_block",
        r"return projected_headroom\(self\.report, projected, self\.overlay\.engine\)",
        "return lazy_headroom(self.report, projected, self.overlay.engine)",
        fast=True,
    ),
    Mutation(
        "unexplained-usage-dropped",
        "a pinned engine's usage that its flights do not explain is left out of its peak",
        (
            "tests/core/test_projection.py::test_usage_an_engines_flights_do_not_explain_stays_under_its_peak",
        ),
        "choose_engine",
        r"unexplained = max\(0, used - sum\(f\.now_tokens for f in group\)\)",
        "unexplained = 0",
        fast=True,
    ),
    Mutation(
        "store-rechecks-projected-fit",
        "the store's full-demand check overrules the projection on a node only this replica reserves",
        (
            "tests/e2e/test_memory_pressure_e2e.py::test_the_projection_decides_the_fit_not_the_rule_of_full_demands",
        ),
        "MemoryPressure.decided_here",
        r"out\.add\(n\.name\)",
        "pass",
    ),
    Mutation(
        "decided-ignores-other-replicas",
        "the store's check is skipped on a node where another replica holds a reservation",
        ("tests/gateway/test_projection_decides.py",),
        "MemoryPressure.decided_here",
        r"if self\._foreign\(n\) == 0:",
        "if True:",
        fast=True,
    ),
    # ---- the tiny path's shortcuts
    Mutation(
        "forwarded-headers-ignored",
        "the lean path never runs the proxy-header layers, X-Forwarded-* or not",
        ("tests/api/test_lean_path.py::test_forwarded_headers_are_honoured_alike_on_both_paths",),
        "forwarded",
        r"if name in FORWARDED_HEADERS:",
        "if False:",
        fast=True,
    ),
    Mutation(
        "watch-starts-before-its-time",
        "one timer starts every pending client watch, due or not",
        (
            "tests/gateway/test_hot_path.py::test_watches_start_at_their_own_time_and_only_while_their_block_runs",
        ),
        "DueWatches._start_due",
        r"if due > now:",
        "if False:",
        fast=True,
    ),
    Mutation(
        "unlocked-histogram-bucket-off-by-one",
        "an amount equal to a bound is counted in the next bucket up",
        ("tests/gateway/test_loop_metrics.py",),
        "_unlock_histogram",
        r"i = bisect_left\(bounds, amount\)",
        "i = bisect_left(bounds, amount + 1e-12)",
        fast=True,
    ),
    Mutation(
        "young-generation-at-the-default",
        "serving collects the young generation every 700 allocations, as CPython's default",
        ("tests/api/test_heap.py::test_a_started_gateway_has_frozen_its_startup_heap",),
        "freeze_startup_heap",
        r"gc\.set_threshold\(YOUNG_THRESHOLD, older, oldest\)",
        "gc.set_threshold(700, older, oldest)",
        fast=True,
    ),
    # ---- the expected-wait model (queueing backends)
    Mutation(
        "wait-ignores-inflight",
        "the expected wait ignores the gateway's own requests in flight",
        (
            "tests/routing/test_catalog_and_queueing.py::test_expected_wait_counts_the_gateways_own_requests_in_flight",
        ),
        "expected_wait_s",
        r"queued = max\(waiting, ov\.inflight - running\)",
        "queued = waiting",
        fast=True,
    ),
    Mutation(
        "wait-ignores-kv-deficit",
        "the expected wait ignores the part of the request that does not fit",
        (
            "tests/routing/test_catalog_and_queueing.py::test_expected_wait_grows_with_the_queue_and_the_kv_deficit",
        ),
        "expected_wait_s",
        r"deficit = demand - n\.usable_block\(\)",
        "deficit = 0",
        fast=True,
    ),
    Mutation(
        "starving-request-stops-the-fleet",
        "a held request at its overtake limit stops every newer placement, not its one node's",
        (
            "tests/core/test_aging.py::test_a_starving_request_keeps_one_node_and_newer_ones_take_the_others",
        ),
        "HeldOrder.may_place",
        r" and h\.target is None",
        "",
        fast=True,
    ),
    Mutation(
        "no-backfill",
        "a newer request that ends before the kept room frees is kept from that node anyway",
        (
            "tests/core/test_aging.py::test_a_newer_request_that_ends_before_the_kept_room_frees_may_take_that_node",
        ),
        "HeldOrder.kept",
        r"\n\s*and steps >= h\.free_in",
        "",
        fast=True,
    ),
    Mutation(
        "projection-peak-at-the-end",
        "a paged node's projected peak taken as what is held now plus the longest remaining",
        ("tests/core/test_projection.py",),
        "projected_peak",
        r"peak = max\(peak, held \+ k \* f\.remaining\)",
        "peak = max(peak, held + f.remaining)",
        fast=True,
    ),
    Mutation(
        "drain-keeps-accepting",
        "a drain closes uvicorn's listener but not the eager acceptor's copy of it",
        ("tests/api/test_shutdown.py::test_sigterm_mid_stream_lets_the_stream_finish",),
        "DrainingServer.shutdown",
        r"acceptor\.close\(\)",
        "pass",
        fast=True,
    ),
    Mutation(
        "accept-one-a-turn",
        "the eager acceptor takes one waiting connection per readiness, as libuv does",
        ("tests/api/test_eager_accept.py",),
        "EagerAccept._ready",
        r"self\._start\(conn\)",
        "self._start(conn)\n            return",
        fast=True,
    ),
    Mutation(
        "snapshot-read-awaited",
        "every request past the refresh interval waits for the fleet read (a loop turn when busy)",
        (
            "tests/state/test_fleet_cache.py::test_while_a_read_runs_the_snapshot_before_it_is_served",
        ),
        "FleetCache.snapshot",
        r"if age < self\.stale_s and reading is not None and not reading\.done\(\):",
        "if False:",
        fast=True,
    ),
    Mutation(
        "snapshot-served-to-its-reader",
        "the request that starts the fleet read is served the view before it: a reservation released since is still in it",
        (
            "tests/state/test_fleet_cache.py::test_a_quiet_gateway_does_not_see_a_released_reservation",
            "tests/state/test_fleet_cache.py::test_a_quiet_gateway_sees_nothing_older_than_refresh_s",
        ),
        "FleetCache.snapshot",
        r"if age < self\.stale_s and reading is not None and not reading\.done\(\):",
        "if age < self.stale_s:",
        fast=True,
    ),
    Mutation(
        "drain-seen-late",
        "a drain made by this replica waits for the next fleet read to be seen",
        (
            "tests/state/test_fleet_cache.py::test_a_drain_made_here_is_in_the_very_next_snapshot",
            "tests/api/test_admin.py::test_requests_sent_right_after_a_drain_avoid_the_node",
        ),
        "Maintenance.set_draining",
        r"self\.fleet\.invalidate\(\)",
        "pass",
        fast=True,
    ),
    Mutation(
        "scrape-on-the-busy-loop",
        "backends are scraped on the gateway's own loop, timed out when it runs late",
        (
            "tests/backends/test_collector.py::test_a_busy_gateway_loop_does_not_time_its_backends_out",
        ),
        "Collector._scrape",
        r"return await self\._thread\.scrape\(backend, self\._config\.collector, self\._slots\(\), taken_at\)",
        "return await __import__('proxy.backends.scrape', fromlist=['scrape']).scrape("
        "await self._http(), backend, self._config.collector.timeout_s, lambda: taken_at)",
        fast=True,
    ),
    Mutation(
        "scrape-causes-blurred",
        "a refused connection is counted as some other HTTP failure in kvroute_scrapes_total",
        (
            "tests/backends/test_collector.py::test_scrape_round_writes_reports_and_marks_failures_down",
        ),
        "scrape:scrape",
        r'return _failed\(backend, reason, started, "connect"\)',
        'return _failed(backend, reason, started, "transport")',
        fast=True,
    ),
    Mutation(
        "deadline-drops-a-read-reply",
        "a store call's deadline cancels at once when due, before the reply the loop read is taken",
        (
            "tests/state/test_deadline.py::test_a_reply_read_as_the_deadline_falls_due_is_not_a_timeout",
        ),
        "lag_tolerant_timeout._expire",
        r"self\._after_io\(_AFTER_IO_HOPS\)",
        "self._after_io(0)",
        fast=True,
    ),
    Mutation(
        "lane-closes-cut-off-calls",
        "a lane connection whose call the deadline cut off is closed, not settled and reused",
        (
            "tests/state/test_redis_store.py::test_calls_cut_off_by_the_deadline_keep_their_connections",
        ),
        "RedisLane._send",
        r"settle = written and conn\.is_connected",
        "settle = False",
    ),
    Mutation(
        "retry-refused-at-once",
        "a retry over the budget's cap answers the failure at once instead of waiting for a slot",
        (
            "tests/faults/test_fault_gateway.py::test_retries_over_the_budget_wait_for_a_slot_instead_of_failing",
            "tests/gateway/test_steps.py::test_a_retry_waits_for_the_budget_slot_a_release_frees",
        ),
        "retry_slot",
        r"if not await gw\.budget\.acquire_within\(lambda: gw\.active, wait_s\):",
        "if not gw.budget.try_acquire(gw.active):",
        fast=True,
    ),
    Mutation(
        "forgotten-ids-never-pruned",
        "the Redis reserve never prunes lapsed forgotten ids: the gone set only grows",
        ("tests/state/test_redis_store.py::test_forgotten_ids_stay_out_of_the_reservations_hash",),
        "LUA_RESERVE",
        r"^redis\.call\('ZREMRANGEBYSCORE', KEYS\[3\], '-inf', ARGV\[3\]\)$",
        "-- MUTATION: no prune",
        fast=True,
    ),
    Mutation(
        "forget-shortens-a-refusal",
        "a second forget of an id with an earlier until shortens its refusal (Redis)",
        ("tests/state/test_redis_store.py::test_forgotten_ids_stay_out_of_the_reservations_hash",),
        "LUA_FORGET",
        r"if cur == nil or cur < tonumber\(ARGV\[2\]\) then",
        "if true then",
        fast=True,
    ),
    Mutation(
        "probe-timed-on-the-busy-loop",
        "an active health probe times out by the busy gateway loop's timers, not the backend",
        (
            "tests/gateway/test_health_probe.py::test_a_busy_loop_does_not_fail_a_healthy_backends_probe",
        ),
        "Gateway._probe",
        r"async with lag_tolerant_timeout\(timeout_s\):",
        "async with __import__('asyncio').timeout(timeout_s):",
    ),
    Mutation(
        "long-body-left-behind",
        "a request body long enough to go beside its head is not sent at all",
        (
            "tests/upstream/test_lean_client.py::test_bodies_of_every_size_arrive_whole_and_the_connection_is_reused",
        ),
        "request_bytes",
        r"\[head, body\] if",
        "[head] if",
        fast=True,
    ),
    Mutation(
        "local-view-counts-what-the-snapshot-shows",
        "this replica's running sums keep a reservation confirmed before the newest snapshot",
        ("tests/gateway/test_local_view.py",),
        "LocalReservations.confirm",
        r"b\.uncount\(e\)  # a snapshot newer",
        "pass  # a snapshot newer",
        fast=True,
    ),
    Mutation(
        "output-quantile-keeps-what-left-the-window",
        "the sorted copy of the learned ratios never drops a sample the window forgot",
        ("tests/core/test_projection.py",),
        "OutputRatios.observe",
        r"del ordered\[bisect_left\(ordered, ratios\[0\]\)\]",
        "pass",
        fast=True,
    ),
    Mutation(
        "projection-even-split-on-data-parallel",
        "a data-parallel node's flights split evenly over its engines, whatever they hold",
        ("tests/core/test_projection.py",),
        "busiest_engine_peak",
        r"return max\(even, busiest\)",
        "return even",
        fast=True,
    ),
    Mutation(
        "learned-output-across-classes",
        "a request class without samples of its own projected at the model-wide ratio",
        (
            "tests/e2e/test_memory_pressure_e2e.py::test_a_class_without_its_own_samples_counts_at_max_tokens_not_at_another_classs",
        ),
        "MemoryPressure.keys",
        r'ctx\.output_keys = \[f"\{client\}\|\{model\}", model\] if client else \[model\]',
        'ctx.output_keys = [f"{client}|{model}", model, f"model:{ctx.parsed.model}"]',
    ),
    Mutation(
        "non-streamed-answers-teach-nothing",
        "a whole JSON answer's usage is not learned from",
        (
            "tests/e2e/test_memory_pressure_e2e.py::test_non_streamed_answers_teach_the_output_length_too",
        ),
        "whole_answer",
        r"^(\s*)gw\.pressure\.answered\(ctx, backend, answer_json\)$",
        r"\1pass  # MUTATION",
    ),
    # ---- outage vs capacity vs fragmentation
    Mutation(
        "outage-judged-on-memory",
        "nodes that could not take the request (down, draining) are judged on memory",
        ("tests/routing/test_nothing_fits.py",),
        "judge",
        r"usable = \[n for n in nodes if reasons\[n\.name\] is None\]",
        "usable = list(nodes)",
        fast=True,
    ),
    Mutation(
        "fragmentation-as-capacity",
        "a node with the memory but no block is reported as capacity",
        ("tests/routing/test_nothing_fits.py",),
        "judge",
        r"^(\s*)elif room:$",
        r"\1elif False:",
        fast=True,
    ),
    Mutation(
        "advice-down-node-memory",
        "advice counts a down node's last report as fleet memory",
        ("tests/ops/test_advice.py::test_a_down_nodes_last_report_is_not_fleet_memory",),
        "_fleet_numbers",
        r"reporting = \[n for n in snapshot\.nodes if n\.up and n\.report is not None\]",
        "reporting = [n for n in snapshot.nodes if n.report is not None]",
        fast=True,
    ),
    Mutation(
        "advice-tie",
        "a tie of one capacity and one fragmentation failure goes to restart",
        ("tests/ops/test_advice.py",),
        "decide",
        r"if short and short >= still_fragmented:",
        "if short and short > still_fragmented:",
        fast=True,
    ),
    Mutation(
        "advice-block-size",
        "'still fragmented' ignores block size",
        ("tests/ops/test_advice.py::test_still_fragmented_counts_whole_blocks",),
        "_still_fragmented",
        r"r\.whole_blocks\(f\.demand\)",
        "f.demand",
        fast=True,
    ),
    Mutation(
        "classify-503",
        "capacity phrases matched only on 500/507, not 503",
        ("tests/upstream/test_classify.py",),
        "classify_response",
        r"if status in \(500, 503, 507\) and",
        "if status in (500, 507) and",
        fast=True,
    ),
    Mutation(
        "classify-case",
        "capacity phrases matched without case folding",
        ("tests/upstream/test_classify.py",),
        "classify_response",
        r"lowered = body\[:4096\]\.lower\(\)",
        "lowered = body[:4096]",
        fast=True,
    ),
    Mutation(
        "classify-424",
        "TGI's 424 generation errors not read by the generic classifier (xfail rows)",
        ("tests/upstream/test_classify.py::test_real_servers_errors_are_classified",),
    ),
    # ---- degraded routing (Redis away)
    Mutation(
        "no-report-ignores-pools",
        "nodes with no report yet: length-only routing ignores the long pool",
        (NO_REPORT_RANKING,),
        "KvroutePolicy.rank",
        r"unknown\.sort\(key=lambda n: \(n\.role != want, ",
        "unknown.sort(key=lambda n: (",
        fast=True,
    ),
    Mutation(
        "no-report-pinned",
        "nodes with no report yet: every request to the first backend by name",
        (NO_REPORT_RANKING,),
        "KvroutePolicy.rank",
        r"\(n\.role != want, n\.overlay\.inflight, n\.name\)",
        "(n.role != want, n.name)",
        fast=True,
    ),
    # ---- admission
    Mutation(
        "admission-deadline",
        "the queue waits 10 x queue.max_wait_s",
        (
            "tests/e2e/test_admission_queue_e2e.py::test_queued_request_gets_503_after_max_wait_not_much_later",
        ),
        "hold_limit_s",
        r"limit = ctx\.cfg\.queue\.max_wait_s$",
        "limit = 10 * ctx.cfg.queue.max_wait_s",
    ),
    Mutation(
        "admission-unbounded",
        "queue.max_size ignored",
        (
            "tests/e2e/test_admission_queue_e2e.py::test_full_queue_answers_503_at_once_and_a_waiter_gets_through_when_memory_frees",
        ),
        "Admission.try_enter",
        r"if self\.depth >= self\.max_size:",
        "if False:  # MUTATION",
    ),
    # ---- vLLM's metrics, data parallel included
    Mutation(
        "vllm-dp-override",
        "data-parallel vLLM: a configured capacity not divided per engine",
        ("tests/backends/test_collector.py", DP_CAPACITY),
        "vllm:memory_report",
        r"engine_capacity = capacity_override // engines",
        "engine_capacity = capacity_override",
        fast=True,
    ),
    Mutation(
        "vllm-dp-size-divided",
        "data-parallel vLLM: the per-engine kv_cache_size_tokens read as the whole server's",
        (DP_CAPACITY,),
        "Geometry.engine_tokens",
        r"return self\.kv_cache_size_tokens$",
        "return self.kv_cache_size_tokens // max(1, engines)",
        fast=True,
    ),
    Mutation(
        "vllm-dp-blocks-not-divided",
        "data-parallel vLLM: the summed num_gpu_blocks read as one engine's",
        (DP_CAPACITY, "tests/backends/test_collector.py"),
        "Geometry.engine_tokens",
        r"self\.num_gpu_blocks // max\(1, engines\) \* self\.block_size",
        "self.num_gpu_blocks * self.block_size",
        fast=True,
    ),
    # ---- KV-event index updates (proxy.core.exact_prefix)
    Mutation(
        "kv-removed-ignored",
        "BlockRemoved events leave the blocks in the exact index",
        (KV_INDEX,),
        "EngineIndex.apply",
        r"self\._drop\(\(event\.medium, key\)\)",
        "pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "kv-cleared-ignored",
        "AllBlocksCleared (an engine restart) leaves the exact index as it was",
        (KV_INDEX, "tests/upstream/test_kv_events_protocol.py"),
        "EngineIndex.apply",
        r"^(\s*)self\.clear\(\)$",
        r"\1pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "kv-index-unbounded",
        "the exact index grows past max_blocks",
        (KV_INDEX,),
        "EngineIndex._stored",
        r"while len\(self\._held\) > self\.max_blocks:",
        "while False:",
        fast=True,
    ),
    Mutation(
        "kv-shared-block-dropped",
        "a block two engine entries share is forgotten when one of them is removed",
        (KV_INDEX,),
        "EngineIndex._drop",
        r"if n > 0:",
        "if False:",
        fast=True,
    ),
    Mutation(
        "vllm-usage-as-free",
        "vLLM usage read as the free share",
        ("tests/backends/test_collector.py", "tests/backends/test_collector_reports.py"),
        "_engine_free",
        r"return round\(\(1\.0 - usage\) \* blocks\) \* geo\.block_size",
        "return round(usage * blocks) * geo.block_size",
        fast=True,
    ),
    # ---- every limit in api/limits.py
    Mutation(
        "limit-header-size",
        "oversized headers are not refused (431)",
        (LIMITS_BOTH_PATHS,),
        "RequestGuard.header_refusal",
        r"if header_bytes\(headers\) > self\.max_header_bytes:",
        "if False:",
    ),
    Mutation(
        "limit-two-authorizations",
        "more than one Authorization header is let through",
        (LIMITS_BOTH_PATHS,),
        "RequestGuard.header_refusal",
        r"if authorization_count\(headers\) > 1:",
        "if False:",
    ),
    Mutation(
        "limit-api-key",
        "a wrong client API key is let through",
        ("tests/faults/test_fault_gateway.py::test_client_api_keys",),
        "RequestGuard.header_refusal",
        r"if not key_allowed\(bearer_key\(headers\), self\.keys\):",
        "if False:",
    ),
    Mutation(
        "limit-declared-body-size",
        "a declared Content-Length over the limit is read anyway",
        (
            "tests/api/test_lean_path.py::test_a_declared_body_over_the_limit_is_refused_before_it_is_sent",
        ),
        "RequestGuard.check_declared",
        r"if declared is not None and declared > self\.max_body:",
        "if False:",
    ),
    Mutation(
        "limit-body-deadline-per-chunk",
        "the body deadline restarts with every chunk (a trickle is never cut)",
        ("tests/api/test_security.py::test_a_trickled_body_is_cut_by_the_whole_bodys_deadline",),
        "RequestGuard.read_body",
        r"self\.body_deadline\(started, size\)",
        "self.body_deadline(loop.time(), size)",
    ),
    Mutation(
        "limit-concurrency",
        "limits.max_concurrent_requests ignored",
        ("tests/api/test_lean_path.py::test_the_concurrency_limit_holds_on_the_lean_path",),
        "RequestGuard.with_body",
        r"if self\.inflight >= self\.max_concurrent:",
        "if False:",
    ),
    Mutation(
        "limit-body-budget",
        "limits.max_buffered_body_bytes ignored",
        ("tests/api/test_security.py::test_bytes_buffered_across_requests_are_bounded",),
        "RequestGuard.take",
        r"if not self\.budget\.take\(len\(chunk\)\):",
        "if False:",
    ),
    # ---- secrets
    Mutation(
        "log-authorization",
        "the request's headers (Authorization too) logged",
        ("tests/api/test_logs.py",),
        "Gateway.handle",
        r"^(\s*)(request_id = safe_request_id\(.*\) or reservation_id)$",
        r'\1\2\n\1log.warning("request headers %s", dict(request.headers))',
    ),
    # ---- exact sizing from cached chunks
    Mutation(
        "chunk-cut-after-the-space",
        "chunks cut right after the space instead of before it (not a piece boundary)",
        ("tests/core/test_chunk_count.py::test_tiktoken_ids_equal_a_full_encode_cold_and_warm",),
        "cut_points",
        r"idx = np\.flatnonzero\(mask\) \+ w$",
        "idx = np.flatnonzero(mask) + w + 1",
    ),
    # ---- prefix hashes from position-independent pieces
    Mutation(
        "pieces-joined-with-the-wrong-power",
        "a piece's carry multiplied by B^(L-1) instead of B^L (pieces no longer compose)",
        ("tests/core/test_chain_hash.py::test_pieces_anywhere_give_the_hashes_of_their_ids",),
        "pieces_hashes_from",
        r"g = \(g \* table\.item\(size\)",
        "g = (g * table.item(size - 1)",
        fast=True,
    ),
    Mutation(
        "hash-memo-trusts-a-reused-identity",
        "the hash memo uses an entry without checking its pieces are the very objects handed in",
        (
            "tests/core/test_hash_memo.py::test_an_entry_is_used_only_while_its_pieces_are_the_very_objects_handed_in",
        ),
        "HashMemo._longest",
        r"if not all\(r\(\) is p for r, p in zip\(entry\.refs, pieces, strict=False\)\):",
        "if False:",
        fast=True,
    ),
    Mutation(
        "pieces-cache-counts-a-shared-piece-per-text",
        "the pieces cache counts a piece shared by many texts once per text (a cycle of them thrashes)",
        (
            "tests/core/test_hash_memo.py::test_texts_sharing_a_piece_count_it_once_in_the_pieces_cache",
        ),
        "PiecesCache._hold",
        r"                seen\[0\] \+= 1",
        "                seen[0] += 1\n                self._held += p.size",
        fast=True,
    ),
    Mutation(
        "tail-from-the-last-cut",
        "a text's tail taken from the window's last cut, not its first",
        (
            "tests/core/test_chunk_tails.py::test_the_tail_is_kept_once_it_comes_behind_a_second_head",
        ),
        "TailMemo.find",
        r"cut = cuts\[0\]$",
        "cut = cuts[-1]",
        fast=True,
    ),
    # ---- prefill during a decode hold: capped per prefill server, released on every path
    Mutation(
        "early-prefill-uncapped",
        "a prefill server takes prefills for held requests whatever it already holds",
        (
            "tests/core/test_early_prefill.py",
            "tests/e2e/test_disaggregation_hold_e2e.py::test_prefills_during_a_hold_are_capped_per_prefill_server_and_released",
        ),
        "EarlyPrefills.full",
        r"if self\.tokens\(name\) \+ prompt_tokens > fraction \* capacity\.get\(name, 0\)$",
        "if False",
    ),
    Mutation(
        "early-prefill-leak",
        "a held request that ends without step 2 (its client left) stays counted on the prefill server",
        (
            "tests/e2e/test_disaggregation_hold_e2e.py::test_prefills_during_a_hold_are_capped_per_prefill_server_and_released",
        ),
        "disaggregated:end",
        r"^(\s*)gw\.early_prefills\.release\(ctx\.reservation_id\)$",
        r"\1pass  # MUTATION",
    ),
    # ---- SGLang's protocol: both halves at once, neither outliving the other's failure
    Mutation(
        "sglang-prefill-outlives-decode",
        "a pair whose decode half refused (or whose client left) keeps its prefill half running",
        (
            "tests/e2e/test_sglang_pd_e2e.py::test_a_decode_server_out_of_memory_moves_the_pair_and_aborts_its_room",
        ),
        "sglang_pd:_race",
        r"^(\s*)await prefill\.stop\(\)$",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "sglang-decode-waits-out-failed-prefill",
        "a pair whose prefill half failed first leaves its decode half waiting in the empty room",
        (
            "tests/e2e/test_sglang_pd_e2e.py::test_a_prefill_that_fails_first_cancels_its_decode_at_once",
        ),
        "sglang_pd:_race",
        r"^(\s*)await second\.stop\(\)$",
        r"\1await second.task  # MUTATION",
    ),
    Mutation(
        "sglang-lost-transfer-blames-decode",
        "a decode server whose KV never came (its prefill server killed) is left out of the retry",
        (
            "tests/e2e/test_sglang_pd_e2e.py::test_a_prefill_server_killed_while_it_computes_moves_the_pair_to_another_one",
        ),
        "sglang_pd:after_divert",
        r"^(\s*)ctx\.exclude\.discard\(decode\)$",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "decode-spread",
        "a long request's decode step spreads instead of taking the tightest decode server",
        ("tests/routing/test_decode_fit.py",),
        "DecodeFitPolicy.rank",
        r"return sorted\(ranked, key=room\)$",
        "return ranked",
        fast=True,
    ),
    # ---- a request routed on its bound: the reservation shrinks to the exact count
    Mutation(
        "bound-never-shrinks",
        "a request placed on its upper bound keeps the bound reserved after its exact count",
        (
            "tests/e2e/test_bound_route_e2e.py::test_the_reservation_shrinks_to_the_exact_count_when_it_arrives",
        ),
        "bound_route:attach.done",
        r"^(\s*)_shrink_to\(gw, ctx, exact\)$",
        r"\1pass  # MUTATION",
    ),
    Mutation(
        "shrink-revives",
        "a shrink that reaches the store after the release re-creates the reservation",
        (
            "tests/state/test_state_contract.py::test_shrink_lowers_a_live_reservation_and_never_revives_one",
        ),
        "InProcessStore.shrink_now",
        r"held = self\._res\.get\(name, \{\}\)\.get\(field\)$",
        "held = self._res.setdefault(name, {}).get(field) "
        "or Reservation(reservation_id, tokens + 1, 0.0, float('inf'))",
    ),
    # ---- KV events: applied in pieces, the event loop running between them
    Mutation(
        "kv-feed-holds-the-loop",
        "a long store's pieces are applied without letting the event loop run between them",
        (
            "tests/upstream/test_kv_events_protocol.py::test_a_long_store_is_applied_in_pieces_with_the_loop_running_between_them",
        ),
        "RankFeed._apply_events",
        r"^(\s*)await asyncio\.sleep\(0\)$",
        r"\1pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "kv-slices-lose-the-chain",
        "each piece of a long store starts a new chain instead of continuing the previous one",
        (
            "tests/core/test_kv_events_index.py::test_an_event_applied_in_pieces_leaves_the_index_as_the_whole_event",
        ),
        "slices",
        r"^(\s*)parent = piece\[-1\]$",
        r"\1parent = None  # MUTATION",
        fast=True,
    ),
    # ---- llama.cpp: slots are regions too
    Mutation(
        "llamacpp-slot-holds-only-what-it-has",
        "a busy slot counts only what it holds now, not prompt + max tokens (the unified pool overfills)",
        (
            "tests/backends/test_llamacpp.py::test_unified_free_is_the_pool_less_what_busy_slots_will_grow_to",
            "tests/backends/test_llamacpp.py::test_captured_unified_pool_counts_busy_slots_at_prompt_plus_max_tokens",
        ),
        "Slot.holds",
        r"self\.prompt_tokens \+ max\(self\.n_predict, self\.decoded\)",
        "self.prompt_tokens + self.decoded  # MUTATION",
        fast=True,
    ),
    Mutation(
        "llamacpp-partition-is-one-pool",
        "a partitioned server's largest block is its free cells, not its largest idle slot",
        (
            "tests/backends/test_llamacpp.py::test_partitioned_largest_block_is_the_largest_idle_slot_and_the_rest_is_fragmentation",
        ),
        "llamacpp:memory_report",
        r"^(\s*)largest = max\(idle, default=0\)$",
        r"\1largest = free  # MUTATION",
        fast=True,
    ),
    Mutation(
        "llamacpp-pool-forgets-unshown-flights",
        "a unified pool counts only what /slots shows and reservations newer than the report",
        (
            "tests/backends/test_llamacpp.py::test_a_unified_pool_counts_the_gateways_flights_that_slots_do_not_show_yet",
        ),
        "NodeView.usable_block",
        r"^(\s*)if self\.report\.counts_flights:$",
        r"\1if False:  # MUTATION",
        fast=True,
    ),
    Mutation(
        "llamacpp-partition-held-at-the-gateway",
        "a partitioned server with every slot busy takes nothing, though it defers what one slot holds",
        (
            "tests/backends/test_llamacpp.py::test_a_partitioned_server_with_every_slot_busy_takes_what_one_slot_holds",
            "tests/routing/test_slot_queue.py::test_every_slot_busy_a_request_joins_a_partitioned_servers_queue_not_the_gateways",
        ),
        "NodeView.fits",
        r"need <= self\.queued_block\(\) or ",
        "",
        fast=True,
    ),
    Mutation(
        "llamacpp-slot-queues-unranked",
        "requests that wait in a server's slots go to the first by today's order, not the shortest queue",
        (
            "tests/routing/test_slot_queue.py::test_every_slot_busy_a_request_joins_a_partitioned_servers_queue_not_the_gateways",
        ),
        "KvroutePolicy.rank",
        r"sorted\(self\._order\(waiting, req\), key=slot_turns\)",
        "self._order(waiting, req)",
        fast=True,
    ),
    Mutation(
        "llamacpp-slot-queues-unbounded",
        "requests join a server's line however many wait there, not only as the next one",
        (
            "tests/routing/test_slot_queue.py::test_a_request_joins_a_servers_line_only_as_the_next_one_else_it_is_held",
        ),
        "KvroutePolicy.rank",
        r"elif not queued_ahead\(n\):",
        "else:",
        fast=True,
    ),
    Mutation(
        "llamacpp-slots-counted-by-the-report-alone",
        "a slot the report shows idle counts as idle though the gateway has sent it a request since",
        (
            "tests/routing/test_slot_queue.py::test_an_idle_slot_counts_only_if_the_gateways_flights_leave_it_idle",
        ),
        "_waits",
        r"return slot_turns\(n\) > 0 or ",
        "return ",
        fast=True,
    ),
    Mutation(
        "llamacpp-store-refuses-the-queue",
        "the store's atomic reserve refuses a request the server would queue (embedded store)",
        (
            "tests/state/test_state_contract.py::test_reserve_where_the_server_queues_what_one_slot_holds_is_never_refused_for_room",
        ),
        "reservation_fits",
        r"if need <= report\.queued_up_to_tokens:",
        "if False:",
    ),
    Mutation(
        "llamacpp-context-failure-is-the-clients",
        "llama-server's context failures read as the client's or the server's, not this node's capacity",
        ("tests/backends/test_llamacpp.py::test_context_failures_are_this_nodes_capacity",),
        "llamacpp:classify",
        r"^(\s*)return \"allocation\"$",
        r"\1return generic_class(status)  # MUTATION",
        fast=True,
    ),
    Mutation(
        "stale-report-occupancy",
        "the slot order takes a report a scrape old over the gateway's own flights",
        (
            "tests/routing/test_slot_order_counts_flights.py::test_a_server_whose_slots_freed_since_its_report_ranks_free_at_once",
        ),
        "queueing:occupied",
        r"if r is None or n\.overlay\.inflight:",
        "if r is None:",
        fast=True,
    ),
    Mutation(
        "slot-turns-with-unknown-limits",
        "slot turns rank servers whose limit is not learned yet as free beside those with one",
        (
            "tests/routing/test_slot_order_counts_flights.py::test_a_server_whose_limit_is_not_learned_yet_does_not_look_free",
        ),
        "KvroutePolicy._order",
        r"turns = slot_limits_known\(queued\)",
        "turns = True",
        fast=True,
    ),
    Mutation(
        "slot-wait-with-unknown-limits",
        "the expected wait sends a held request to a server whose limit is not learned yet",
        (
            "tests/routing/test_catalog_and_queueing.py::test_the_expected_wait_leaves_slot_waits_out_where_a_limit_is_not_known",
        ),
        "rank_by_wait",
        r"slot_wait = slot_limits_known\(nodes\)",
        "slot_wait = True",
        fast=True,
    ),
    Mutation(
        "early-share-claimed-late",
        "a held request's prefill share is not taken when step 1 is decided: every held request woken at once sees it free",
        (
            "tests/gateway/test_hold_prefill.py::test_a_share_is_taken_when_step_1_is_decided_and_in_the_order_requests_found_none",
        ),
        "claim_share",
        r"book\.add\(first, ctx\.reservation_id, ctx\.prompt_tokens\)",
        "pass",
        fast=True,
    ),
    Mutation(
        "shares-out-of-order",
        "a prefill share that frees goes to whichever held request looks first, not the one that waited longest",
        (
            "tests/core/test_early_prefill.py::test_a_freed_share_goes_to_the_request_that_waited_longest",
            "tests/gateway/test_hold_prefill.py::test_a_share_is_taken_when_step_1_is_decided_and_in_the_order_requests_found_none",
        ),
        "EarlyPrefills.turn",
        r"return next\(iter\(self\.waiting\), key\) == key",
        "return True",
        fast=True,
    ),
    Mutation(
        "held-document-reserves-decode-first",
        "while others are held, a document reserves decode room before its prompt is computed (the room stands empty)",
        (
            "tests/gateway/test_hold_prefill.py::test_while_anything_is_held_a_document_reserves_no_decode_room_before_its_prompt",
        ),
        "held_room:nodes_kept",
        r"if not order\.may_place\(key\) or prefill_pending\(ctx\):",
        "if not order.may_place(key):",
        fast=True,
    ),
    Mutation(
        "released-reservation-still-in-view",
        "a reservation released here stays in a snapshot read before the release (served while a busy gateway's next read runs)",
        (
            "tests/gateway/test_local_view.py::test_a_snapshot_read_before_a_release_shows_only_what_is_still_held",
        ),
        "LocalReservations.remove",
        r"b\.released\.append\(\(self\.clock\(\), e\)\)",
        "pass",
        fast=True,
    ),
    Mutation(
        "ended-flight-not-freed",
        "KV a flight held when it ended counts as foreign usage until the next scrape",
        (
            "tests/gateway/test_projection_decides.py::test_room_a_flight_freed_since_the_report_is_free_at_once_and_counted_once",
        ),
        "MemoryPressure._project",
        r"r\.capacity_tokens - r\.free_tokens - self\.freed\.since\(n\.name, r\.reported_at\)",
        "r.capacity_tokens - r.free_tokens",
        fast=True,
    ),
    Mutation(
        "ended-flights-unbounded",
        "ended flights on a backend no projection reads are kept for ever (memory grows with every request)",
        (
            "tests/core/test_ended_flights.py::test_a_node_no_projection_asks_about_keeps_no_more_than_the_horizon",
        ),
        "EndedFlights.ended",
        r"self\._drop\(backend, at - HORIZON_S, inclusive=False\)",
        "pass",
        fast=True,
    ),
    Mutation(
        "ended-step-1-freed",
        "step 1's end frees its prefill server's KV in the projection, though the blocks stay until pulled",
        (
            "tests/gateway/test_projection_decides.py::test_room_a_flight_freed_since_the_report_is_free_at_once_and_counted_once",
        ),
        "MemoryPressure.ended",
        r" and ctx\.counts_request",
        "",
        fast=True,
    ),
    Mutation(
        "retry-not-held",
        "a retry that nothing takes now gets the last failure at once (a busy backend could serve it)",
        (
            "tests/e2e/test_retry_held_e2e.py::test_a_retry_that_nothing_takes_now_waits_for_a_busy_backend_not_a_502",
        ),
        "placement:_place",
        r"return give_up\(gw, ctx\) if ctx\.failure is not None else nothing_fits\(gw, ctx, verdict\)",
        "return give_up(gw, ctx) if ctx.failure is not None else nothing_fits(gw, ctx, verdict)\n        if ctx.failure is not None:\n            return give_up(gw, ctx)",
    ),
    Mutation(
        "hold-limit-no-partitioned-line",
        "a hold that ran its limit is answered 503 though a llama.cpp partitioned server would queue it",
        (
            "tests/e2e/test_llamacpp_e2e.py::test_a_request_held_its_limit_joins_a_partitioned_servers_line_not_a_503",
        ),
        "join_queue",
        r"names \+= gw\.queues\.deferring\(ctx, view, avoid, now\)",
        "pass",
    ),
    # ---- the endpoint picker (proxy/epp)
    Mutation(
        "epp-no-release-when-closed",
        "a stream that closes before its answer ends keeps its reservation",
        ("tests/epp/test_ext_proc_client.py::test_a_stream_cut_after_the_pick_releases_once",),
        "Exchange.close",
        r'^(\s*)self\.answer\.end\("closed"\)$',
        r"\1pass  # MUTATION",
        fast=True,
    ),
    Mutation(
        "epp-picks-twice",
        "trailers after a whole body place the request again (the first pick leaks)",
        ("tests/epp/test_ext_proc_client.py::test_trailers_end_a_body_and_never_pick_twice",),
        "Exchange.on",
        r"^(\s*)decided = \[\] if self\.decided else await self\._decide\(peer\)$",
        r"\1decided = await self._decide(peer)  # MUTATION",
        fast=True,
    ),
    Mutation(
        "epp-subset-ignored",
        "the subset hint is not honoured",
        ("tests/epp/test_envoy_e2e.py::test_subset_hint",),
        "Exchange._leave_out",
        r"^(\s*)return self\.endpoints\.names_outside\(self\.subset\)$",
        r"\1return frozenset()  # MUTATION",
    ),
)


def functions(tree: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Every function under ``proxy/`` by qualified name (``Class.method``, ``outer.inner``),
    also under ``module:qualname``: where it is (file, first and last line). A module-level
    constant (``NAME = ...``: the Redis store's Lua scripts) is found by its name the same way."""
    found: dict[str, list[tuple[Path, int, int]]] = {}

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                not prefix
                and isinstance(child, ast.Assign)
                and len(child.targets) == 1
                and isinstance(child.targets[0], ast.Name)
                and child.targets[0].id.isupper()
            ):
                where = (path, child.lineno, child.end_lineno or child.lineno)
                found.setdefault(child.targets[0].id, []).append(where)
                found.setdefault(f"{path.stem}:{child.targets[0].id}", []).append(where)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    where = (path, child.lineno, child.end_lineno or child.lineno)
                    found.setdefault(qual, []).append(where)
                    found.setdefault(f"{path.stem}:{qual}", []).append(where)
                visit(child, qual + ".", path)

    for path in sorted((tree / "proxy").rglob("*.py")):
        visit(ast.parse(path.read_text()), "", path)
    return found


def locate(
    m: Mutation, tree: Path, index: dict[str, list[tuple[Path, int, int]]]
) -> str | tuple[Path, int, int]:
    """Where ``m`` applies (file, first and last line of its function), or why it is stale."""
    assert m.anchor is not None and m.pattern is not None
    places = index.get(m.anchor, [])
    if not places:
        return f"STALE: no function {m.anchor!r} under proxy/"
    if len(places) > 1:
        where = ", ".join(f"{p.relative_to(tree)}:{a}" for p, a, _ in places)
        return f"STALE: {m.anchor!r} is ambiguous ({where}): prefix the module"
    path, first, last = places[0]
    source = "".join(path.read_text().splitlines(keepends=True)[first - 1 : last])
    hits = len(re.findall(m.pattern, source, re.MULTILINE))
    if hits != 1:
        how = "not found" if hits == 0 else f"found {hits} times"
        return f"STALE: pattern {how} in {m.anchor} ({path.relative_to(tree)})"
    return places[0]


def apply(m: Mutation, tree: Path) -> str | None:
    """Patch the copy; None when applied, else why not (a stale row)."""
    place = locate(m, tree, functions(tree))
    if isinstance(place, str):
        return place
    path, first, last = place
    assert m.pattern is not None
    lines = path.read_text().splitlines(keepends=True)
    source = "".join(lines[first - 1 : last])
    patched = re.sub(m.pattern, m.replacement, source, count=1, flags=re.MULTILINE)
    path.write_text("".join(lines[: first - 1]) + patched + "".join(lines[last:]))
    return None


def guard_exists(guard: str, tree: Path) -> str | None:
    """None when the guard's file (and test, if named) exists; else why it is stale."""
    file, _, test = guard.partition("::")
    path = tree / file
    if not path.is_file():
        return f"STALE: guard file {file} does not exist"
    test = test.partition("[")[0]
    if test and not re.search(
        rf"^(async )?def {re.escape(test)}\(", path.read_text(), re.MULTILINE
    ):
        return f"STALE: no test {test} in {file}"
    return None


def stale(m: Mutation, tree: Path, index: dict[str, list[tuple[Path, int, int]]]) -> list[str]:
    """Why ``m`` no longer tests what it says (empty: it resolves)."""
    why = [w for g in m.guards if (w := guard_exists(g, tree)) is not None]
    if m.pattern is not None:
        place = locate(m, tree, index)
        if isinstance(place, str):
            why.append(place)
    return why


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what the tests would see in a checkout."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [p for p in out.split("\0") if p]


def copy_tree(root: Path, dest: Path) -> None:
    for rel in tree_files(root):
        src = root / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_guards(
    tree: Path, guards: tuple[str, ...], extra: list[str], timeout_s: float
) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *extra, *guards]
    try:
        done = subprocess.run(
            argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return done.returncode, (done.stdout + done.stderr)[-1500:]


def verdict(m: Mutation, rc: int) -> str:
    if rc == 1:
        return "caught"
    if rc == 0:
        return "MISSED"
    return f"error (pytest rc {rc})"


def each_guard(tree: Path, m: Mutation, timeout_s: float) -> tuple[str, str]:
    """Run every guard on its own: which of them notice (not only the first to fail)."""
    missed: list[str] = []
    tail = ""
    for guard in m.guards:
        rc, out = run_guards(tree, (guard,), [], timeout_s)
        if rc != 1:
            missed.append(f"{guard.rsplit('::', 1)[-1]} ({verdict(m, rc)})")
            tail = out
    caught = len(m.guards) - len(missed)
    if not missed:
        return f"caught by each of {caught} guards", tail
    return f"caught by {caught} of {len(m.guards)}; not by {', '.join(missed)}", tail


def check(chosen: list[Mutation]) -> int:
    """Resolve every row against the working tree, no tests run: 1 if any is stale."""
    index = functions(ROOT)
    bad = [(m.name, why) for m in chosen for why in stale(m, ROOT, index)]
    for name, why in bad:
        print(f"{name}: {why}")
    print(f"{len(chosen) - len({n for n, _ in bad})} of {len(chosen)} mutations resolve")
    return 1 if bad else 0


def run_one(m: Mutation, args: argparse.Namespace) -> tuple[str, str, str]:
    """(result, unmutated, pytest's tail) of one mutation in a fresh copy of the tree."""
    base, tail = "-", ""
    with tempfile.TemporaryDirectory(prefix=f"kvroute-mut-{m.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(ROOT, tree)
        if args.baseline and m.pattern is not None:
            rc, _ = run_guards(tree, m.guards, [], args.timeout)
            base = "pass" if rc == 0 else f"FAIL (rc {rc})"
        if m.pattern is None:
            # A property today's code lacks: its xfail guard must fail when run as a test.
            rc, tail = run_guards(tree, m.guards, ["--runxfail"], args.timeout)
            return ("caught (today's code, xfail)" if rc == 1 else verdict(m, rc)), base, tail
        why = apply(m, tree)
        if why is not None:
            return why, base, tail
        if args.each and len(m.guards) > 1:
            result, tail = each_guard(tree, m, args.timeout)
        else:
            rc, tail = run_guards(tree, m.guards, [], args.timeout)
            result = verdict(m, rc)
        return result, base, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="mutation names (substring)")
    ap.add_argument("--ci", action="store_true", help="only the fast subset (what .ci/run runs)")
    ap.add_argument("--check", action="store_true", help="only check every row resolves")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true", help="also run each guard unmutated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    ap.add_argument("--each", action="store_true", help="run every guard on its own")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's tail per row")
    args = ap.parse_args(argv)
    chosen = [
        m
        for m in MUTATIONS
        if (not args.only or any(o in m.name for o in args.only)) and (m.fast or not args.ci)
    ]
    if args.list:
        for m in chosen:
            where = f"{m.anchor}: {m.pattern}" if m.anchor else "xfail row"
            print(
                f"{m.name:28s} {m.what}\n{'':28s} in {where}\n{'':28s} guards: {', '.join(m.guards)}"
            )
        return 0
    if args.check:
        return check(chosen)
    index = functions(ROOT)
    rows: list[tuple[str, str, str, str, float]] = []
    for m in chosen:
        t0 = time.monotonic()
        gone = [w for g in m.guards if (w := guard_exists(g, ROOT)) is not None]
        if gone:
            result, base, tail = "; ".join(gone), "-", ""
        elif m.pattern is not None and isinstance(why := locate(m, ROOT, index), str):
            result, base, tail = why, "-", ""
        else:
            result, base, tail = run_one(m, args)
        took = time.monotonic() - t0
        rows.append((m.name, m.what, result, base, took))
        print(f"{m.name}: {result} ({took:.0f}s)", flush=True)
        if args.verbose or result.startswith(("MISSED", "error")):
            print(tail)
    print()
    print("| mutation | what breaks | result | unmutated | s |")
    print("|---|---|---|---|---|")
    for name, what, result, base, took in rows:
        print(f"| {name} | {what} | {result} | {base} | {took:.0f} |")
    # Stale rows fail the run like missed ones: a mutation that tests nothing must be fixed.
    missed = [r for r in rows if not r[2].startswith("caught") or " not by " in r[2]]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
