"""llama.cpp's ``llama-server`` -> ``MemoryReport`` (kind ``llamacpp``).

llama.cpp removed its KV gauges from ``/metrics`` (``kv_cache_usage_ratio``,
``kv_cache_tokens``), so occupancy is worked out from its slots. A scrape reads three pages:

* ``/slots``: one entry per slot: ``n_ctx`` (the slot's context), ``is_processing``, and for a
  busy slot ``n_prompt_tokens``, ``params.n_predict`` (the request's max tokens, -1: none)
  and ``next_token[0].n_decoded``;
* ``/props``: ``total_slots`` and ``default_generation_settings.n_ctx`` (the slot size), to
  check ``/slots`` against;
* ``/metrics`` (``--metrics``): ``llamacpp:requests_deferred`` (requests waiting for a slot)
  and the prompt counters (tokens and seconds prefilled).

How the slots share the KV cache is not shown by any page (the server only logs
``kv_unified``), so the backend's config says it (``kv_layout``):

* **unified** (``--kv-unified``, and llama-server's default with ``-np`` auto): one pool of
  ``n_ctx`` cells that every slot draws from, each slot able to grow to the whole pool. What
  fits is the pool less what the busy slots hold *and will grow to* (prompt + max tokens;
  the whole slot without a max). Overcommitting it is what fails every request in flight
  with a 500 "Context size has been exceeded", so this is also the reading without config:
  on a partitioned server it under-uses the slots, never overfills them.
* **partitioned** (``-np N`` without ``--kv-unified``): each slot a fixed region of
  ``n_ctx / N`` cells. The largest free block is the largest idle slot; a busy slot's unused
  cells count as free but in no block (fragmentation by partition). A request that fits one
  slot is never refused for room: with every slot busy the server defers it and starts it
  when one frees (``queued_up_to_tokens``: the gateway sends it there to wait, as the next
  in line, rather than holding it, ``proxy.routing.kvroute``).

Both are contiguous allocators in kvroute's terms (``queueing`` off): the report is exact at
admission, and the gateway's reservations newer than it are subtracted from it; and since
``/slots`` shows a request only once the server has read it (seconds late on a loaded CPU),
every reservation the gateway holds there also counts against the cells at its full demand
(``counts_flights``: committed = max(what the slots hold, what is in flight)). With no idle
slot, or requests already deferred, nothing fits now and nothing counts as free (a
partitioned server still queues what one slot holds; ``max_num_seqs`` is the slot count). A
partitioned server's free cells are split by its configuration, not by use: the restart
advice leaves it out (``proxy.ops.maintenance.partitioned_slots``). No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.backends import samples as sm
from proxy.backends.base import (
    ErrorClass,
    ModelsInfo,
    ServedModel,
    error_fields,
    generic_class,
    model_entries,
    positive_int,
)
from proxy.config.base import KvLayout
from proxy.core.fleet import MemoryReport

PROPS_PATH = "/props"
SLOTS_PATH = "/slots"
#: What a scrape reads besides the backend's ``metrics_path``, before it. ``/slots`` first:
#: the server answers it (and ``/metrics``) between two steps of its loop, seconds apart on
#: a CPU, and the report is taken as of the scrape's start: a request the gateway sends
#: after that start and the server puts in a slot before answering counts twice until the
#: next report (its reservation is newer than the report), so that window is kept short.
PAGES: tuple[str, ...] = (SLOTS_PATH, PROPS_PATH)

DEFERRED = "llamacpp:requests_deferred"
PROCESSING = "llamacpp:requests_processing"
PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
PROMPT_SECONDS = "llamacpp:prompt_seconds_total"
WANTED: frozenset[str] = frozenset({DEFERRED, PROCESSING, PROMPT_TOKENS, PROMPT_SECONDS})

# The server's own words for its two capacity failures (tools/server: ERROR_TYPE_EXCEED_CONTEXT_SIZE,
# and the decode that finds no room in a unified pool).
EXCEED_CONTEXT_TYPE = "exceed_context_size_error"
CONTEXT_EXCEEDED_TEXT = "context size has been exceeded"


@dataclass(frozen=True, slots=True)
class Slot:
    """One slot as ``/slots`` shows it."""

    n_ctx: int
    busy: bool
    prompt_tokens: int = 0
    decoded: int = 0
    # The request's max new tokens; -1: none (it may grow to the whole slot).
    n_predict: int = -1

    def holds(self) -> int:
        """Cells this slot's request holds now or will grow to (0 when idle)."""
        if not self.busy:
            return 0
        if self.n_predict < 0:
            return self.n_ctx
        grown = self.prompt_tokens + max(self.n_predict, self.decoded)
        return min(self.n_ctx, grown)


@dataclass(frozen=True, slots=True)
class Props:
    total_slots: int
    slot_n_ctx: int


def _json(body: bytes, page: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise sm.ScrapeError(f"{page} is not JSON") from None


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise sm.ScrapeError(f"{what} is not an integer ({value!r})")
    return value


def parse_props(body: bytes) -> Props:
    """``/props``: the slot count and each slot's context."""
    doc = _json(body, PROPS_PATH)
    if not isinstance(doc, dict) or not isinstance(doc.get("default_generation_settings"), dict):
        raise sm.ScrapeError(f"{PROPS_PATH} has no default_generation_settings")
    slots = _int(doc.get("total_slots"), "total_slots")
    n_ctx = _int(doc["default_generation_settings"].get("n_ctx"), "n_ctx")
    if slots <= 0 or n_ctx <= 0:
        raise sm.ScrapeError(f"{PROPS_PATH}: total_slots {slots}, n_ctx {n_ctx}")
    return Props(slots, n_ctx)


def _slot(entry: object) -> Slot:
    if not isinstance(entry, dict):
        raise sm.ScrapeError(f"{SLOTS_PATH}: a slot is not an object")
    n_ctx = _int(entry.get("n_ctx"), "slot n_ctx")
    if n_ctx <= 0:
        raise sm.ScrapeError(f"{SLOTS_PATH}: slot n_ctx {n_ctx}")
    if not entry.get("is_processing"):
        return Slot(n_ctx, False)
    params = entry.get("params")
    n_predict = params.get("n_predict", -1) if isinstance(params, dict) else -1
    nxt = entry.get("next_token")
    first = nxt[0] if isinstance(nxt, list) and nxt else nxt
    decoded = first.get("n_decoded", 0) if isinstance(first, dict) else 0
    return Slot(
        n_ctx,
        True,
        max(0, _int(entry.get("n_prompt_tokens", 0), "n_prompt_tokens")),
        max(0, _int(decoded, "n_decoded")),
        _int(n_predict, "n_predict"),
    )


def parse_slots(body: bytes) -> tuple[Slot, ...]:
    """``/slots``: every slot, idle or busy."""
    doc = _json(body, SLOTS_PATH)
    if isinstance(doc, dict) and "error" in doc:
        message, _type, _code = error_fields(body)
        raise sm.ScrapeError(f"{SLOTS_PATH}: {message} (start llama-server with --slots)")
    if not isinstance(doc, list) or not doc:
        raise sm.ScrapeError(f"{SLOTS_PATH} is not a list of slots")
    return tuple(_slot(e) for e in doc)


def memory_report(
    props: Props,
    slots: tuple[Slot, ...],
    samples: sm.Samples,
    layout: KvLayout,
    now: float,
    capacity_override: int | None,
) -> MemoryReport:
    if len(slots) != props.total_slots:
        raise sm.ScrapeError(
            f"{SLOTS_PATH} lists {len(slots)} slots, {PROPS_PATH} says {props.total_slots}"
        )
    deferred = sm.count(DEFERRED, sm.optional_sum(samples, DEFERRED))
    idle = [s.n_ctx for s in slots if not s.busy]
    if layout == "unified":
        # Every slot's n_ctx is the pool's size.
        capacity = max(s.n_ctx for s in slots)
        free = max(0, capacity - sum(s.holds() for s in slots))
        largest = free
    else:
        capacity = sum(s.n_ctx for s in slots)
        free = sum(s.n_ctx - s.holds() for s in slots)
        largest = max(idle, default=0)
    if not idle or deferred:
        # A new request would wait for a slot: nothing fits now, and nothing is free for it
        # (a full node, not a fragmented one).
        free = largest = 0
    capacity, free, largest = sm.clamped(capacity, free, largest, capacity_override)
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator="contiguous",
        block_size=1,
        running=sum(1 for s in slots if s.busy),
        waiting=deferred,
        reported_at=now,
        prefill_tokens=sm.optional_sum(samples, PROMPT_TOKENS),
        prefill_seconds=sm.optional_sum(samples, PROMPT_SECONDS),
        # /slots shows a request late: a unified pool overfilled fails them all, and
        # partitioned slots would queue more than they hold.
        counts_flights=True,
        max_num_seqs=len(slots),
        queued_up_to_tokens=queued_up_to(slots, layout, capacity),
    )


def queued_up_to(slots: tuple[Slot, ...], layout: KvLayout, capacity: int) -> int:
    """The largest request the server defers rather than refuses when no slot has room for it.

    Partitioned: one slot's ``n_ctx`` (the smallest, should they differ). With every slot
    busy, llama-server defers a new request (``requests_deferred``) and starts it in the
    first slot that frees, which holds it whole: it waits, it never fails for room. A
    unified pool: 0, since a deferred request that starts when a slot frees may overfill
    the shared cells, which fails every request in flight there.
    """
    if layout == "unified":
        return 0
    return min(min(s.n_ctx for s in slots), capacity)


def parse_models(body: bytes) -> ModelsInfo:
    """``/v1/models``: ids, and each one's ``meta.n_ctx`` (one slot's context) as the limit.

    llama-server refuses a prompt of a slot's ``n_ctx`` or more (400
    ``exceed_context_size_error``), whatever its total KV, so a slot is the longest request
    it can serve.
    """
    out: list[ServedModel] = []
    for entry in model_entries(body):
        meta = entry.get("meta")
        n_ctx = positive_int(meta.get("n_ctx")) if isinstance(meta, dict) else None
        out.append(ServedModel(entry["id"], n_ctx))
    return ModelsInfo(tuple(out))


def classify(status: int, body: bytes) -> ErrorClass:
    """Both of llama-server's context failures are this node's capacity, not the client's.

    500 "Context size has been exceeded.": a unified pool overcommitted (every request in
    flight there failed with it); 400 ``exceed_context_size_error``: the prompt is longer
    than this node's slot, which another node's slot may hold.
    """
    message, err_type, _code = error_fields(body)
    if err_type == EXCEED_CONTEXT_TYPE or CONTEXT_EXCEEDED_TEXT in message:
        return "allocation"
    return generic_class(status)


class LlamacppAdapter:
    kind = "llamacpp"
    pages = PAGES

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        raise sm.ScrapeError(f"kind llamacpp needs {PROPS_PATH} and {SLOTS_PATH} besides /metrics")

    def parse_pages(
        self,
        text: str,
        pages: Mapping[str, bytes],
        layout: KvLayout,
        now: float,
        capacity_override: int | None = None,
    ) -> MemoryReport:
        """``/metrics`` text and the bodies of ``PAGES`` -> the report."""
        if PROPS_PATH not in pages or SLOTS_PATH not in pages:
            raise sm.ScrapeError(f"kind llamacpp needs {PROPS_PATH} and {SLOTS_PATH}")
        props = parse_props(pages[PROPS_PATH])
        slots = parse_slots(pages[SLOTS_PATH])
        samples = sm.parse_selected(text, WANTED)
        return memory_report(props, slots, samples, layout, now, capacity_override)

    def parse_models(self, body: bytes) -> ModelsInfo:
        return parse_models(body)

    def classify_error(self, status: int, body: bytes) -> ErrorClass:
        return classify(status, body)
