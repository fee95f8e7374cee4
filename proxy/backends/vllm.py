"""vLLM's own metric names -> ``MemoryReport`` (kind ``vllm``; also ``paged`` without kvroute gauges).

What vLLM exports (``vllm/v1/metrics/loggers.py``, ``vllm/config/cache.py``) and how it is read:

* ``vllm:cache_config_info`` is a gauge fixed at 1 whose *labels* are every cache setting as
  a string: ``block_size``, ``num_gpu_blocks`` (``"None"`` until profiled) and, in current
  versions, ``kv_cache_size_tokens``. The latter is the true capacity in tokens and wins:
  for hybrid models (sliding window, Mamba layers) ``num_gpu_blocks x block_size`` is far
  off (320 x 8 = 2,560 against 463,459 seen in the wild).
* Data parallel behind one API server: every series carries ``engine="N"``, and
  ``cache_config_info`` repeats the front end's cache settings on each engine's series. The
  front end *sums* ``num_gpu_blocks`` over the engines but keeps ``kv_cache_size_tokens``
  per engine (``vllm/v1/engine/core_client.py``: "Keep these as per-engine
  cache_config_info values; do not sum across DP"). So capacity is ``kv_cache_size_tokens``
  times the engines, or ``num_gpu_blocks x block_size`` (already the sum); each label is
  read once, never added over the repeated series. Two engines of 320,000 tokens: 640,000.
* ``vllm:kv_cache_usage_perc`` (0..1, per engine) is current; ``vllm:gpu_cache_usage_perc``
  was deprecated, hidden and then removed, and is read only when the new name is absent.
  Free blocks still holding cached prefixes are in vLLM's free queue, so they count as
  free here, which is right: they are reclaimed on demand.
* vLLM's front end picks an engine by queue length, not by KV space, so a request fits this
  URL only if it fits whichever engine gets it: ``largest_free_block_tokens`` is the
  *smallest* engine's free tokens (conservative), ``free_tokens`` their sum.
* ``vllm:engine_sleep_state{sleep_state="awake"} 0``: a sleeping engine shows near-zero
  usage; it is counted as having no free space, and the report says ``sleeping``.
* ``vllm:num_requests_waiting`` / ``_running`` and ``vllm:num_preemptions_total`` feed the
  queue/preemption signals; ``process_start_time_seconds`` is optional (absent with
  several API server processes).
* Prefill rate (the expected wait's divisor): the sums of V1's per-request histograms,
  observed together when a request finishes: ``vllm:request_prefill_time_seconds`` (first
  scheduled to first token) against ``vllm:request_prefill_kv_computed_tokens`` (tokens
  actually computed, cache hits excluded; newer versions) or else
  ``vllm:request_prompt_tokens``. Without the prefill histogram, time to first token less
  queue time (``vllm:time_to_first_token_seconds`` minus ``vllm:request_queue_time_seconds``)
  stands in. Summed over engines: the ratio is per engine. Absent: 0, and the configured
  rate is used.
"""

from __future__ import annotations

import dataclasses

from proxy.backends import kvroute
from proxy.backends import samples as sm
from proxy.backends.base import (
    ErrorClass,
    ModelsInfo,
    error_fields,
    generic_class,
    parse_openai_models,
    says_out_of_memory,
)
from proxy.core.fleet import MemoryReport

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_REMOVED = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG = "vllm:cache_config_info"
SLEEP_STATE = "vllm:engine_sleep_state"
START_TIME = "process_start_time_seconds"
PREFILL_TIME_SUM = "vllm:request_prefill_time_seconds_sum"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
QUEUE_TIME_SUM = "vllm:request_queue_time_seconds_sum"
COMPUTED_TOKENS_SUM = "vllm:request_prefill_kv_computed_tokens_sum"
PROMPT_TOKENS_SUM = "vllm:request_prompt_tokens_sum"
PREFILL_SERIES = (
    PREFILL_TIME_SUM,
    TTFT_SUM,
    QUEUE_TIME_SUM,
    COMPUTED_TOKENS_SUM,
    PROMPT_TOKENS_SUM,
)

WANTED: frozenset[str] = frozenset(
    {
        KV_USAGE,
        KV_USAGE_REMOVED,
        RUNNING,
        WAITING,
        PREEMPTIONS,
        CACHE_CONFIG,
        SLEEP_STATE,
        START_TIME,
        *PREFILL_SERIES,
    }
)


def has_gauges(samples: sm.Samples) -> bool:
    return KV_USAGE in samples or KV_USAGE_REMOVED in samples


def _usage_by_engine(samples: sm.Samples) -> dict[str, float]:
    """engine -> usage fraction; the same engine under several model names is one cache."""
    name = KV_USAGE if KV_USAGE in samples else KV_USAGE_REMOVED
    found = samples.get(name)
    if not found:
        raise sm.ScrapeError(
            f"required metric {KV_USAGE} (or the older {KV_USAGE_REMOVED}) is missing"
        )
    usage: dict[str, float] = {}
    for engine, group in sm.by_label(found, "engine").items():
        usage[engine] = max(sm.fraction(name, s.value) for s in group)
    return usage


def _asleep(samples: sm.Samples) -> set[str]:
    """Engines whose ``awake`` series reads 0."""
    return {
        s.labels.get("engine", "")
        for s in samples.get(SLEEP_STATE)
        if s.labels.get("sleep_state") == "awake" and s.value == 0
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Geometry:
    """The cache as ``cache_config_info`` describes it (see the module docstring for DP)."""

    block_size: int | None
    #: Summed over data-parallel engines by vLLM's front end.
    num_gpu_blocks: int | None
    #: One engine's capacity, not summed.
    kv_cache_size_tokens: int | None

    def engine_tokens(self, engines: int) -> int | None:
        """One engine's capacity in tokens; None when the labels do not say."""
        if self.kv_cache_size_tokens:
            return self.kv_cache_size_tokens
        if self.block_size and self.num_gpu_blocks:
            return self.num_gpu_blocks // max(1, engines) * self.block_size
        return None


def geometry(samples: sm.Samples) -> Geometry:
    found = samples.get(CACHE_CONFIG)
    if not found:
        return Geometry(None, None, None)
    # Every engine's series repeats the same front-end settings: read one, never add them.
    labels = found[0].labels
    return Geometry(
        sm.int_label(labels, "block_size"),
        sm.int_label(labels, "num_gpu_blocks"),
        sm.int_label(labels, "kv_cache_size_tokens"),
    )


def _engine_free(geo: Geometry, engine_capacity: int, engines: int, usage: float) -> int:
    """Free tokens on one engine: whole free blocks when the block count is what we have."""
    if geo.kv_cache_size_tokens is None and geo.block_size and geo.num_gpu_blocks:
        blocks = geo.num_gpu_blocks // engines
        return round((1.0 - usage) * blocks) * geo.block_size
    return round((1.0 - usage) * engine_capacity)


def prefill_counters(samples: sm.Samples) -> tuple[float, float]:
    """(prompt tokens prefilled, seconds prefilling) so far, all engines; (0, 0) if unknown."""
    if PREFILL_TIME_SUM in samples:
        seconds = sm.optional_sum(samples, PREFILL_TIME_SUM)
    elif TTFT_SUM in samples and QUEUE_TIME_SUM in samples:
        seconds = sm.optional_sum(samples, TTFT_SUM) - sm.optional_sum(samples, QUEUE_TIME_SUM)
    else:
        return 0.0, 0.0
    name = COMPUTED_TOKENS_SUM if COMPUTED_TOKENS_SUM in samples else PROMPT_TOKENS_SUM
    tokens = sm.optional_sum(samples, name)
    if tokens <= 0 or seconds <= 0:
        return 0.0, 0.0
    return tokens, seconds


def memory_report(samples: sm.Samples, now: float, capacity_override: int | None) -> MemoryReport:
    usage = _usage_by_engine(samples)
    engines = len(usage)
    geo = geometry(samples)
    engine_capacity = geo.engine_tokens(engines)
    if engine_capacity is None:
        if capacity_override is None:
            which = "kv_cache_size_tokens or block_size/num_gpu_blocks"
            raise sm.ScrapeError(
                f"{CACHE_CONFIG} lacks usable {which} labels "
                "(set capacity_tokens on the backend to scrape it anyway)"
            )
        # No geometry (not exported yet, or "None"): the operator's capacity (the whole
        # server's) stands in, split evenly over the engines.
        engine_capacity = capacity_override // engines
        geo = Geometry(None, None, engine_capacity)
    asleep = _asleep(samples)
    per_engine = tuple(
        0 if e in asleep else _engine_free(geo, engine_capacity, engines, u)
        for e, u in sorted(usage.items())
    )
    capacity, free, largest = sm.clamped(
        engine_capacity * engines, sum(per_engine), min(per_engine), capacity_override
    )
    prefill_tokens, prefill_seconds = prefill_counters(samples)
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator="paged",
        block_size=geo.block_size or 1,
        running=sm.count(RUNNING, sm.optional_sum(samples, RUNNING)),
        waiting=sm.count(WAITING, sm.optional_sum(samples, WAITING)),
        started_at=sm.optional_max(samples, START_TIME),
        reported_at=now,
        preemptions=sm.count(PREEMPTIONS, sm.optional_sum(samples, PREEMPTIONS)),
        engines=engines,
        engine_free_tokens=tuple(min(f, free) for f in per_engine),
        queueing=True,
        sleeping=bool(asleep & set(usage)),
        prefill_tokens=prefill_tokens,
        prefill_seconds=prefill_seconds,
    )


def classify(status: int, body: bytes) -> ErrorClass:
    """vLLM fails nothing for lack of KV (it queues or preempts); an OOM text is still one."""
    message, _type, _code = error_fields(body)
    if status >= 500 and says_out_of_memory(message):
        return "allocation"
    return generic_class(status)


class VllmAdapter:
    """Kind ``vllm``: vLLM's names, or the kvroute gauges when a patched server exports them."""

    kind = "vllm"

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        samples = sm.parse_selected(text, WANTED | kvroute.WANTED)
        if kvroute.has_gauges(samples):
            # Exact gauges, taken with the exporter's own semantics: a server that exports
            # them (the simulated kvroute engine) allocates at admission, so not "queueing".
            exact = kvroute.memory_report(samples, "vllm", now, capacity_override)
            return dataclasses.replace(
                exact, preemptions=sm.count(PREEMPTIONS, sm.optional_sum(samples, PREEMPTIONS))
            )
        if not has_gauges(samples):
            raise sm.ScrapeError(
                f"required metric {KV_USAGE} (or {KV_USAGE_REMOVED}, "
                f"or the kvroute gauges {', '.join(kvroute.REQUIRED)}) is missing"
            )
        return memory_report(samples, now, capacity_override)

    def parse_models(self, body: bytes) -> ModelsInfo:
        return parse_openai_models(body)

    def classify_error(self, status: int, body: bytes) -> ErrorClass:
        return classify(status, body)


class PagedAdapter(kvroute.KvrouteAdapter):
    """Kind ``paged``: the kvroute gauges, falling back to vLLM's names (a stock vLLM server)."""

    def __init__(self) -> None:
        super().__init__("paged")

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        samples = sm.parse_selected(text, WANTED | kvroute.WANTED)
        if kvroute.has_gauges(samples):
            return kvroute.memory_report(samples, "paged", now, capacity_override)
        if has_gauges(samples):
            return memory_report(samples, now, capacity_override)
        raise kvroute.missing()
