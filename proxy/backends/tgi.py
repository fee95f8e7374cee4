"""Text Generation Inference's router metrics -> ``MemoryReport`` (kind ``tgi``).

From TGI's router (``backends/v3``, ``router/src``), unlabelled gauges:

* capacity ``tgi_batch_max_total_tokens``: the token budget the warm-up found for a batch;
* used ~ ``tgi_batch_current_max_tokens``: the budget the running batch holds (each request
  counted at input + max_new_tokens, so this is a commitment, not a current fill level);
* running ``tgi_batch_current_size``, waiting ``tgi_queue_size``.

TGI queues what does not fit the budget, so it is a queueing backend; it has no data
parallel inside one router. Errors are ``{"error": "...", "error_type": "..."}``:
429 ``overloaded`` (queue full: divert), 424 ``generation`` (the shard failed; with an
out-of-memory message this is an allocation failure), 422 ``validation`` and 413 (the
request itself: the client's).
"""

from __future__ import annotations

import orjson

from proxy.backends import samples as sm
from proxy.backends.base import (
    ErrorClass,
    ModelsInfo,
    ServedModel,
    error_fields,
    generic_class,
    parse_openai_models,
    says_out_of_memory,
)
from proxy.core.fleet import MemoryReport

CAPACITY = "tgi_batch_max_total_tokens"
USED = "tgi_batch_current_max_tokens"
RUNNING = "tgi_batch_current_size"
WAITING = "tgi_queue_size"
START_TIME = "process_start_time_seconds"
WANTED: frozenset[str] = frozenset({CAPACITY, USED, RUNNING, WAITING, START_TIME})


def memory_report(samples: sm.Samples, now: float, capacity_override: int | None) -> MemoryReport:
    capacity = sm.count(CAPACITY, sm.required_sum(samples, CAPACITY))
    if capacity <= 0 and capacity_override is None:
        raise sm.ScrapeError(f"{CAPACITY} is {capacity}; TGI has not finished warm-up")
    used = sm.count(USED, sm.optional_sum(samples, USED))
    capacity, free, largest = sm.clamped(
        capacity, max(0, capacity - used), max(0, capacity - used), capacity_override
    )
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator="paged",
        block_size=1,
        running=sm.count(RUNNING, sm.optional_sum(samples, RUNNING)),
        waiting=sm.count(WAITING, sm.optional_sum(samples, WAITING)),
        started_at=sm.optional_max(samples, START_TIME),
        reported_at=now,
        queueing=True,
    )


def parse_models(body: bytes) -> ModelsInfo:
    """TGI's ``/v1/models`` (ids only) or its ``/info`` (``model_id``, ``max_total_tokens``)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if isinstance(doc, dict) and isinstance(doc.get("model_id"), str):
        mtt = doc.get("max_total_tokens")
        ok = isinstance(mtt, int) and not isinstance(mtt, bool) and mtt > 0
        return ModelsInfo((ServedModel(doc["model_id"], mtt if ok else None),))
    return parse_openai_models(body)


def classify(status: int, body: bytes) -> ErrorClass:
    message, err_type, _code = error_fields(body)
    if status == 429 or err_type == "overloaded":
        return "overload"
    if status == 424 or err_type == "generation":
        return "allocation" if says_out_of_memory(message) else "server_error"
    return generic_class(status)


class TgiAdapter:
    kind = "tgi"

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        return memory_report(sm.parse_selected(text, WANTED), now, capacity_override)

    def parse_models(self, body: bytes) -> ModelsInfo:
        return parse_models(body)

    def classify_error(self, status: int, body: bytes) -> ErrorClass:
        return classify(status, body)
