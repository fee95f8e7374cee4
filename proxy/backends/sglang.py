"""SGLang's metric names -> ``MemoryReport`` (kind ``sglang``).

From ``python/sglang/srt/metrics/collector.py``: every scheduler exports its own series,
labelled ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank`` (+ ``moe_ep_rank``) and,
with data parallelism, ``dp_rank``. Each DP rank is its own scheduler with its own token
pool; the tensor-parallel ranks of one DP rank describe the same pool, so one series per
``dp_rank`` is read (the lowest ``tp_rank``/``pp_rank``) and the ranks are added up.

* capacity: ``sglang:max_total_num_tokens`` (tokens in the KV pool);
* free: capacity x (1 - ``sglang:token_usage``); SGLang's usage leaves evictable prefix
  cache out, so reclaimable cache counts as free;
* running ``sglang:num_running_reqs``, waiting ``sglang:num_queue_reqs``;
* like vLLM's data parallel, a request fits only if it fits the rank that gets it: the
  smallest rank's free tokens is the largest request that fits.

SGLang queues rather than fails and retracts (recomputes) running requests when decode runs
out of room, so it is a lazily allocating, queueing backend. Its errors use the flat
``{"object": "error", "message": ..., "type": ..., "code": ...}`` body.
"""

from __future__ import annotations

import math

from proxy.backends import samples as sm
from proxy.backends.base import ErrorClass, ModelsInfo, parse_openai_models
from proxy.backends.vllm import classify as _vllm_style_classify
from proxy.core.bootstrap import transfer_lost
from proxy.core.fleet import MemoryReport

CAPACITY = "sglang:max_total_num_tokens"
TOKEN_USAGE = "sglang:token_usage"
RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
START_TIME = "process_start_time_seconds"
WANTED: frozenset[str] = frozenset({CAPACITY, TOKEN_USAGE, RUNNING, WAITING, START_TIME})


def _rank_key(labels: dict[str, str]) -> tuple[int, int]:
    def num(key: str) -> int:
        try:
            return int(labels.get(key, "0"))
        except ValueError:
            return 0

    return num("tp_rank"), num("pp_rank")


def _per_dp(samples: sm.Samples, name: str, required: bool) -> dict[str, float]:
    """dp_rank -> the value of the lowest tp/pp rank's series (one pool per DP rank)."""
    found = samples.get(name)
    if not found and required:
        raise sm.ScrapeError(f"required metric {name} is missing")
    out: dict[str, float] = {}
    for rank, group in sm.by_label(found, "dp_rank").items():
        first = min(group, key=lambda s: _rank_key(s.labels))
        out[rank] = sm.finite(name, first.value)
    return out


def memory_report(samples: sm.Samples, now: float, capacity_override: int | None) -> MemoryReport:
    caps = _per_dp(samples, CAPACITY, required=True)
    usage = _per_dp(samples, TOKEN_USAGE, required=True)
    ranks = sorted(caps)
    if any(caps[r] <= 0 for r in ranks) and capacity_override is None:
        raise sm.ScrapeError(f"{CAPACITY} is not positive; SGLang has not sized its pool yet")
    per_rank: list[int] = []
    for r in ranks:
        u = sm.fraction(TOKEN_USAGE, usage.get(r, 0.0))
        per_rank.append(round(int(caps[r]) * (1.0 - u)))
    capacity, free, largest = sm.clamped(
        int(sum(caps.values())), sum(per_rank), min(per_rank), capacity_override
    )
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator="paged",
        block_size=1,
        running=sm.count(RUNNING, math.fsum(_per_dp(samples, RUNNING, False).values())),
        waiting=sm.count(WAITING, math.fsum(_per_dp(samples, WAITING, False).values())),
        started_at=sm.optional_max(samples, START_TIME),
        reported_at=now,
        engines=len(ranks),
        engine_free_tokens=tuple(per_rank),
        queueing=True,
    )


class SglangAdapter:
    kind = "sglang"

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        return memory_report(sm.parse_selected(text, WANTED), now, capacity_override)

    def parse_models(self, body: bytes) -> ModelsInfo:
        return parse_openai_models(body)

    def classify_error(self, status: int, body: bytes) -> ErrorClass:
        if status >= 500 and transfer_lost(body):
            # A decode server whose KV never came ("Decode transfer failed ...
            # KVTransferError(bootstrap_room=...)"): a failure, never an out-of-memory, though
            # "bootstrap_room" holds the word "oom" that the vLLM-style reading looks for.
            return "server_error"
        return _vllm_style_classify(status, body)
