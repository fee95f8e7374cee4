"""Backend adapters on golden /metrics pages: capacity, per-engine headroom, errors, models."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from proxy.backends.base import ModelsInfo, ServedModel, says_out_of_memory
from proxy.backends.registry import adapter_for
from proxy.backends.samples import ScrapeError

DATA = Path(__file__).parents[1] / "data" / "metrics"
NOW = 1_760_000_000.0


def page(name: str) -> str:
    return (DATA / name).read_text()


def parse(kind: str, text: str, override: int | None = None):  # type: ignore[no-untyped-def]
    return adapter_for(kind).parse_metrics(text, NOW, override)


# --- vLLM ---------------------------------------------------------------------------------


def test_vllm_one_engine_capacity_is_kv_cache_size_tokens() -> None:
    r = parse("vllm", page("vllm_one_engine.txt"))
    assert r.capacity_tokens == 436_864 == 27_304 * 16
    assert r.free_tokens == r.largest_free_block_tokens == 436_864 * 3 // 4
    assert (r.engines, r.engine_free_tokens) == (1, (327_648,))
    assert (r.running, r.waiting, r.preemptions) == (14, 2, 3)
    assert (r.allocator, r.block_size, r.queueing, r.sleeping) == ("paged", 16, True, False)
    assert r.started_at == 1.75999e9 and r.reported_at == NOW


def test_vllm_hybrid_model_capacity_is_not_blocks_times_block_size() -> None:
    r = parse("vllm", page("vllm_hybrid.txt"))
    assert r.capacity_tokens == 463_459  # not 320 x 8 = 2,560
    assert r.free_tokens == 417_113  # floor(0.9 x 463,459)
    assert r.block_size == 8


def test_vllm_data_parallel_capacity_sums_engines_and_headroom_is_the_smallest_engines() -> None:
    r = parse("vllm", page("vllm_dp2.txt"))
    # kv_cache_size_tokens="320000" is one engine's (vLLM does not sum it across DP).
    assert r.capacity_tokens == 640_000
    assert r.engines == 2
    assert r.engine_free_tokens == (160_000, 280_000)  # 320k each at 50% and 12.5% used
    assert r.free_tokens == 440_000
    assert r.largest_free_block_tokens == 160_000  # the front end may pick either engine
    assert (r.running, r.waiting, r.preemptions) == (49, 3, 9)
    assert r.started_at == 0.0  # several API servers: no process start time


def test_vllm_prefill_counters_from_the_per_request_histograms() -> None:
    r = parse("vllm", page("vllm_dp2.txt"))
    # Sums over both engines: 400k prompt tokens in 40 s of prefill (10k tokens/s per engine).
    assert (r.prefill_tokens, r.prefill_seconds) == (400_000.0, 40.0)
    # Without the prefill histogram: time to first token less queue time (100 - 50 s).
    text = "\n".join(
        ln for ln in page("vllm_dp2.txt").splitlines() if "request_prefill_time" not in ln
    )
    r = parse("vllm", text)
    assert (r.prefill_tokens, r.prefill_seconds) == (400_000.0, 50.0)
    # Tokens actually computed (cache hits excluded) win over prompt tokens when exported.
    computed = 'vllm:request_prefill_kv_computed_tokens_sum{engine="0"} 100000.0\n'
    r = parse("vllm", page("vllm_dp2.txt") + computed)
    assert (r.prefill_tokens, r.prefill_seconds) == (100_000.0, 40.0)
    # Not exported at all (the one-engine page has no prefill histograms): zeros.
    r = parse("vllm", page("vllm_one_engine.txt"))
    assert (r.prefill_tokens, r.prefill_seconds) == (0.0, 0.0)


def test_vllm_data_parallel_blocks_without_kv_cache_size_tokens() -> None:
    text = page("vllm_dp2.txt").replace('kv_cache_size_tokens="320000",', "")
    r = parse("vllm", text)
    # num_gpu_blocks="40000" is the sum: 20,000 blocks of 16 per engine, whole free blocks.
    assert r.capacity_tokens == 40_000 * 16
    assert r.engine_free_tokens == (10_000 * 16, 17_500 * 16)


def test_vllm_num_gpu_blocks_none_needs_a_capacity() -> None:
    text = (
        page("vllm_one_engine.txt")
        .replace('num_gpu_blocks="27304"', 'num_gpu_blocks="None"')
        .replace('kv_cache_size_tokens="436864",', "")
    )
    with pytest.raises(ScrapeError, match="capacity_tokens"):
        parse("vllm", text)
    r = parse("vllm", text, override=100_000)
    assert (r.capacity_tokens, r.free_tokens) == (100_000, 75_000)


def test_vllm_sleeping_engine_does_not_look_empty() -> None:
    awake = parse("vllm", page("vllm_one_engine.txt"))
    text = (
        page("vllm_one_engine.txt")
        .replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0')
        .replace('sleep_state="weights_offloaded"} 0.0', 'sleep_state="weights_offloaded"} 1.0')
        .replace("} 0.25\n", "} 0.0\n")  # asleep, its cache reads empty
    )
    r = parse("vllm", text)
    assert awake.free_tokens > 0 and not awake.sleeping
    assert r.sleeping and r.free_tokens == r.largest_free_block_tokens == 0
    assert r.capacity_tokens == awake.capacity_tokens


def test_vllm_one_sleeping_data_parallel_engine_leaves_no_sure_headroom() -> None:
    text = page("vllm_dp2.txt").replace(
        'engine="1",model_name="Qwen/Qwen2.5-32B-Instruct",sleep_state="awake"} 1.0',
        'engine="1",model_name="Qwen/Qwen2.5-32B-Instruct",sleep_state="awake"} 0.0',
    )
    r = parse("vllm", text)
    assert r.sleeping and r.engine_free_tokens == (160_000, 0)
    assert r.largest_free_block_tokens == 0


def test_vllm_removed_usage_name_is_still_read() -> None:
    text = page("vllm_one_engine.txt").replace(
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
    )
    assert parse("vllm", text).free_tokens == 327_648


def test_vllm_missing_usage_is_named() -> None:
    text = page("vllm_one_engine.txt").replace("vllm:kv_cache_usage_perc", "vllm:other")
    with pytest.raises(ScrapeError, match="vllm:kv_cache_usage_perc"):
        parse("vllm", text)


# --- SGLang and TGI -------------------------------------------------------------------------


def test_sglang_dp_ranks_add_up_counting_one_tp_rank() -> None:
    r = parse("sglang", page("sglang_dp2_tp2.txt"))
    assert r.capacity_tokens == 400_000  # two pools of 200k, not four
    assert r.engine_free_tokens == (150_000, 100_000)
    assert r.free_tokens == 250_000 and r.largest_free_block_tokens == 100_000
    assert (r.running, r.waiting, r.engines, r.queueing) == (22, 5, 2, True)


def test_sglang_missing_capacity_is_named() -> None:
    text = page("sglang_dp2_tp2.txt").replace("sglang:max_total_num_tokens", "sglang:x")
    with pytest.raises(ScrapeError, match="sglang:max_total_num_tokens"):
        parse("sglang", text)


def test_tgi_budget_and_queue() -> None:
    r = parse("tgi", page("tgi.txt"))
    assert r.capacity_tokens == 163_840
    assert r.free_tokens == r.largest_free_block_tokens == 163_840 - 40_960
    assert (r.running, r.waiting, r.queueing) == (12, 3, True)


def test_tgi_before_warmup_is_an_error() -> None:
    with pytest.raises(ScrapeError, match="tgi_batch_max_total_tokens"):
        parse("tgi", page("tgi.txt").replace("tgi_batch_max_total_tokens", "tgi_other"))


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi", "contiguous", "paged"])
def test_html_is_not_metrics(kind: str) -> None:
    with pytest.raises(ScrapeError, match="not valid Prometheus"):
        parse(kind, "<html><body>502 Bad Gateway</body></html>")


# --- error bodies ----------------------------------------------------------------------------


def body(obj: object) -> bytes:
    return orjson.dumps(obj)


@pytest.mark.parametrize(
    ("kind", "status", "payload", "expected"),
    [
        ("tgi", 429, {"error": "Model is overloaded", "error_type": "overloaded"}, "overload"),
        (
            "tgi",
            424,
            {
                "error": "Request failed during generation: Server error: CUDA out of memory.",
                "error_type": "generation",
            },
            "allocation",
        ),
        (
            "tgi",
            424,
            {"error": "Request failed during generation: shard 1 died", "error_type": "generation"},
            "server_error",
        ),
        (
            "tgi",
            422,
            {
                "error": "Input validation error: `inputs` must have less than 4096 tokens.",
                "error_type": "validation",
            },
            "client_error",
        ),
        (
            "sglang",
            400,
            {
                "object": "error",
                "message": "The input (9000 tokens) is longer than the model's context length.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "client_error",
        ),
        (
            "sglang",
            500,
            {"object": "error", "message": "CUDA out of memory", "type": "InternalServerError"},
            "allocation",
        ),
        (
            # A decode server whose KV never came: "bootstrap_room" holds "oom", still no OOM.
            "sglang",
            500,
            {
                "object": "error",
                "message": "Decode transfer failed for request rank=0 "
                "decode_req.req.bootstrap_room=42 with exception "
                "KVTransferError(bootstrap_room=42): Failed to get kvcache from prefill instance",
                "type": "InternalServerError",
            },
            "server_error",
        ),
        (
            "vllm",
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 4096 tokens.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            "client_error",
        ),
        ("vllm", 503, {"error": {"message": "busy", "type": "ServiceUnavailable"}}, "overload"),
        (
            "contiguous",
            503,
            {"error": {"type": "kv_cache_allocation_error", "code": "kv_cache_allocation_failed"}},
            "allocation",
        ),
    ],
)
def test_error_bodies_are_classified(
    kind: str, status: int, payload: object, expected: str
) -> None:
    assert adapter_for(kind).classify_error(status, body(payload)) == expected


# --- /v1/models -------------------------------------------------------------------------------


def test_models_with_and_without_max_model_len() -> None:
    vllm_body = body(
        {
            "object": "list",
            "data": [
                {"id": "llama-8b", "object": "model", "max_model_len": 32_768},
                {
                    "id": "llama-8b-sql",
                    "object": "model",
                    "parent": "llama-8b",
                    "max_model_len": 32_768,
                },
            ],
        }
    )
    info = adapter_for("vllm").parse_models(vllm_body)
    assert info == ModelsInfo(
        (ServedModel("llama-8b", 32_768), ServedModel("llama-8b-sql", 32_768))
    )
    assert info.max_model_len("llama-8b-sql") == 32_768
    tgi_list = adapter_for("tgi").parse_models(
        body({"object": "list", "data": [{"id": "mistral"}]})
    )
    assert tgi_list.ids == ("mistral",) and tgi_list.max_model_len() is None
    tgi_info = adapter_for("tgi").parse_models(
        body({"model_id": "mistral", "max_total_tokens": 8192})
    )
    assert tgi_info.max_model_len("mistral") == 8192
    with pytest.raises(ValueError, match="data"):
        adapter_for("sglang").parse_models(b'{"detail": "Not Found"}')


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("cuda out of memory. tried to allocate 2.00 gib", True),
        ("torch.outofmemoryerror: cuda error", True),
        ("worker oom-killed", True),
        ("oom", True),
        ("no free blocks in the kv cache", True),
        # "oom" inside a word is not a report of memory: SGLang's room ids, a zoom level.
        ("kvtransfererror(bootstrap_room=7): failed to get kvcache", False),
        ("unknown zoom level", False),
        ("waiting room closed", False),
        ("shard 1 died", False),
    ],
)
def test_out_of_memory_is_read_on_word_boundaries(message: str, expected: bool) -> None:
    assert says_out_of_memory(message) is expected


def test_a_vllm_style_500_naming_a_room_is_a_server_error() -> None:
    payload = {"error": {"message": "Request in bootstrap_room 9 was aborted", "type": "x"}}
    assert adapter_for("vllm").classify_error(500, body(payload)) == "server_error"
