"""What differs between the simulated servers: metric names and labels, error bodies, defaults.

Names, label sets and HELP lines follow each server's own source (vLLM
``vllm/v1/metrics/loggers.py``; SGLang ``srt/metrics/collector.py``; TGI's router);
the text of error messages follows the servers' wording where clients match on it
(vLLM's "maximum context length"). The scheduler (``scheduler.PagedCore``) is shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from loadtest.engine.behaviours.scheduler import Histogram, PagedCore

ErrorAnswer = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What a dialect needs to know about the simulated server."""

    model: str
    max_model_len: int
    started_at: float
    cores: Sequence[PagedCore]


class Dialect(Protocol):
    name: str
    owned_by: str

    def families(self, s: ServerFacts) -> Iterable[Metric]: ...

    def too_long(
        self, s: ServerFacts, prompt: int, max_tokens: int, explicit: bool
    ) -> ErrorAnswer: ...

    def not_found(self, model: str) -> ErrorAnswer: ...

    def default_max_tokens(self, s: ServerFacts, chat: bool, prompt: int) -> int: ...


def models_body(s: ServerFacts, owned_by: str, with_max_len: bool) -> bytes:
    entry: dict[str, Any] = {
        "id": s.model,
        "object": "model",
        "created": int(s.started_at),
        "owned_by": owned_by,
        "root": s.model,
        "parent": None,
    }
    if with_max_len:
        entry["max_model_len"] = s.max_model_len
    return orjson.dumps({"object": "list", "data": [entry]})


def _nested(message: str, type_: str, param: str | None, status: int) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}
    )


def _flat(message: str, type_: str, status: int) -> bytes:
    return orjson.dumps(
        {"object": "error", "message": message, "type": type_, "param": None, "code": status}
    )


# --- vLLM ------------------------------------------------------------------------------------


class Vllm:
    name = "vllm"
    owned_by = "vllm"

    def families(self, s: ServerFacts) -> Iterable[Metric]:
        labels = ["model_name", "engine"]
        per = [(str(i), c) for i, c in enumerate(s.cores)]

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for e, c in per:
                g.add_metric([s.model, e], float(value(c)))
            return g

        def counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            for e, c in per:
                m.add_metric([s.model, e], float(value(c)))
            return m

        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=s.started_at,
        )
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda c: len(c.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda c: len(c.waiting),
        )
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*labels, "sleep_state"],
        )
        for e, c in per:
            sleep.add_metric([s.model, e, "awake"], 0.0 if c.sleeping else 1.0)
            sleep.add_metric([s.model, e, "weights_offloaded"], 1.0 if c.sleeping else 0.0)
            sleep.add_metric([s.model, e, "discard_all"], 0.0)
        yield sleep
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda c: c.usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda c: c.stats.prefix_queries if c.prefix is not None else c.stats.prompt_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lambda c: c.stats.prefix_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda c: c.stats.preemptions,
        )
        yield counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            lambda c: c.stats.prompt_tokens,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lambda c: c.stats.generation_tokens,
        )
        # Not vLLM's: the simulator's own figures, for benchmarks (the adapters ignore them).
        yield counter(
            "sim:long_prefill_wait_seconds",
            "Long prompts: seconds from arrival to the start of their prefill, summed.",
            lambda c: c.stats.long_wait_s,
        )
        yield counter("sim:long_prefills", "Long prompts admitted.", lambda c: c.stats.long_waits)
        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=labels,
        )
        for e, c in per:
            ttft.add_metric([s.model, e], c.stats.ttft.exported(), c.stats.ttft.total)
        yield ttft
        yield from self._request_histograms(s)
        yield self._cache_config(s)

    def _request_histograms(self, s: ServerFacts) -> Iterable[Metric]:
        """V1's per-request histograms the gateway learns the prefill rate from."""
        specs = (
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue_time"),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "prefill_time"),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
            ("vllm:request_prefill_kv_computed_tokens", "Prompt tokens computed in prefill, prefix-cache hits excluded.", "computed_tokens"),
        )  # fmt: skip
        for name, doc, attr in specs:
            fam = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
            for i, c in enumerate(s.cores):
                h: Histogram = getattr(c.stats, attr)
                fam.add_metric([s.model, str(i)], h.exported(), h.total)
            yield fam

    def _cache_config(self, s: ServerFacts) -> GaugeMetricFamily:
        """Every cache setting as a string label, as vLLM's front end keeps them: blocks summed
        over the engines, ``kv_cache_size_tokens`` one engine's (``core_client.py``)."""
        first = s.cores[0]
        settings = {
            "block_size": str(first.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "kv_cache_size_tokens": str(first.capacity_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(sum(c.num_blocks for c in s.cores)),
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*settings, "engine"],
        )
        for i in range(len(s.cores)):
            info.add_metric([*settings.values(), str(i)], 1.0)
        return info

    def too_long(self, s: ServerFacts, prompt: int, max_tokens: int, explicit: bool) -> ErrorAnswer:
        limit = s.max_model_len
        if prompt >= limit or not explicit:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt} input tokens. Please reduce the length of the input messages."
            )
        else:
            msg = (
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {limit} tokens and your request has {prompt} input "
                f"tokens ({max_tokens} > {limit} - {prompt})."
            )
        return 400, _nested(msg, "BadRequestError", None, 400)

    def not_found(self, model: str) -> ErrorAnswer:
        return 404, _nested(f"The model `{model}` does not exist.", "NotFoundError", "model", 404)

    def default_max_tokens(self, s: ServerFacts, chat: bool, prompt: int) -> int:
        # vLLM: chat fills the context (max_model_len - prompt); completions default to 16.
        return max(1, s.max_model_len - prompt) if chat else 16


# --- SGLang ----------------------------------------------------------------------------------


class Sglang:
    name = "sglang"
    owned_by = "sglang"

    def families(self, s: ServerFacts) -> Iterable[Metric]:
        dp = len(s.cores) > 1
        names = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        if dp:
            names.append("dp_rank")

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            for i, c in enumerate(s.cores):
                lv = [s.model, "unified", "0", "0", "0"] + ([str(i)] if dp else [])
                g.add_metric(lv, float(value(c)))
            return g

        yield gauge(
            "sglang:num_running_reqs", "The number of running requests.", lambda c: len(c.running)
        )
        yield gauge(
            "sglang:num_used_tokens",
            "The number of used tokens.",
            lambda c: c.used_blocks * c.block_size,
        )
        yield gauge("sglang:token_usage", "The token usage.", lambda c: c.usage)
        yield gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            lambda c: len(c.waiting),
        )
        yield gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            lambda c: c.capacity_tokens,
        )

    def too_long(self, s: ServerFacts, prompt: int, max_tokens: int, explicit: bool) -> ErrorAnswer:
        msg = (
            f"Requested token count exceeds the model's maximum context length of "
            f"{s.max_model_len} tokens. You requested a total of {prompt + max_tokens} tokens: "
            f"{prompt} tokens from the input messages and {max_tokens} tokens for the completion."
        )
        return 400, _flat(msg, "BadRequestError", 400)

    def not_found(self, model: str) -> ErrorAnswer:
        return 404, _flat(f"The model '{model}' does not exist", "NotFoundError", 404)

    def default_max_tokens(self, s: ServerFacts, chat: bool, prompt: int) -> int:
        return 128  # an assumption: SGLang's sampling default for max_new_tokens


# --- TGI -------------------------------------------------------------------------------------


def tgi_error(status: int, message: str, error_type: str) -> ErrorAnswer:
    return status, orjson.dumps({"error": message, "error_type": error_type})


class Tgi:
    name = "tgi"
    owned_by = "text-generation-inference"

    def families(self, s: ServerFacts) -> Iterable[Metric]:
        c = s.cores[0]
        yield GaugeMetricFamily("tgi_queue_size", "", value=float(len(c.waiting)))
        yield GaugeMetricFamily("tgi_batch_current_size", "", value=float(len(c.running)))
        yield GaugeMetricFamily(
            "tgi_batch_current_max_tokens", "", value=float(c.used_blocks * c.block_size)
        )
        yield GaugeMetricFamily("tgi_batch_max_total_tokens", "", value=float(c.capacity_tokens))
        yield CounterMetricFamily("tgi_request_count", "", value=float(c.stats.finished))

    def too_long(self, s: ServerFacts, prompt: int, max_tokens: int, explicit: bool) -> ErrorAnswer:
        msg = (
            f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
            f"{s.max_model_len}. Given: {prompt} `inputs` tokens and {max_tokens} `max_new_tokens`"
        )
        return tgi_error(422, msg, "validation")

    def not_found(self, model: str) -> ErrorAnswer:
        # TGI serves one model and ignores the name a client sends.
        return 0, b""

    def default_max_tokens(self, s: ServerFacts, chat: bool, prompt: int) -> int:
        return 100  # an assumption: TGI's validation default for max_new_tokens


DIALECTS: dict[str, Dialect] = {"vllm": Vllm(), "sglang": Sglang(), "tgi": Tgi()}
