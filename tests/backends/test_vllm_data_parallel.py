"""Data-parallel vLLM behind one URL: capacity is the engines' sum, headroom one engine's.

vLLM's front end sums ``num_gpu_blocks`` over its engines but keeps ``kv_cache_size_tokens``
per engine (``vllm/v1/engine/core_client.py``). The pages below carry the label set vLLM's
``PrometheusStatLogger.log_metrics_info`` writes (every ``CacheConfig`` field, then
``engine``), one series per engine.
"""

from __future__ import annotations

import httpx
import pytest

from proxy.backends.registry import adapter_for
from tests.support.behaviours import engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until

NOW = 1_760_000_000.0
MODEL = "Qwen/Qwen2.5-32B-Instruct"


def dp_page(per_engine_tokens: int, usages: list[float], block_size: int = 16) -> str:
    """A vLLM /metrics page for ``len(usages)`` data-parallel engines, vLLM's own labels."""
    blocks_total = per_engine_tokens // block_size * len(usages)
    settings = {
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_cache_size_tokens": str(per_engine_tokens),
        "kv_sharing_fast_prefill": "False",
        "mamba_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(blocks_total),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
    }
    lines = [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
    ]
    for i, u in enumerate(usages):
        lines.append(f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="{MODEL}"}} {u}')
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for i in range(len(usages)):
        labels = ",".join(f'{k}="{v}"' for k, v in {**settings, "engine": str(i)}.items())
        lines.append(f"vllm:cache_config_info{{{labels}}} 1.0")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("usages", "capacity", "per_engine_free"),
    [
        ([0.5, 0.25], 640_000, (160_000, 240_000)),
        ([0.5, 0.25, 0.0, 0.75], 1_280_000, (160_000, 240_000, 320_000, 80_000)),
    ],
)
def test_capacity_is_the_sum_of_per_engine_kv_cache_size_tokens(
    usages: list[float], capacity: int, per_engine_free: tuple[int, ...]
) -> None:
    r = adapter_for("vllm").parse_metrics(dp_page(320_000, usages), NOW)
    assert r.capacity_tokens == capacity
    assert r.engines == len(usages)
    assert r.engine_free_tokens == per_engine_free
    assert r.free_tokens == sum(per_engine_free)
    # vLLM's front end places by queue length, not KV space: only one engine's headroom is
    # sure, the smallest.
    assert r.largest_free_block_tokens == min(per_engine_free)


def test_without_kv_cache_size_tokens_the_summed_blocks_give_the_same_capacity() -> None:
    page = dp_page(320_000, [0.5, 0.25]).replace('kv_cache_size_tokens="320000",', "")
    r = adapter_for("vllm").parse_metrics(page, NOW)
    assert r.capacity_tokens == 640_000
    assert r.engine_free_tokens == (160_000, 240_000)


def test_fleet_shows_two_320k_engines_as_640k() -> None:
    flags = {"data_parallel": 2, "capacity_tokens": 320_000, "speedup": 20}
    with engines(("vllm", "dp", flags)) as urls:
        cfg = gateway_cfg([{"name": "dp", "url": urls["dp"], "kind": "vllm"}])
        with run_gateway(cfg) as gw:

            def report() -> dict[str, object] | None:
                got = httpx.get(gw + "/fleet", timeout=5).json()["backends"][0]["report"]
                return got if isinstance(got, dict) else None

            wait_until(lambda: report() is not None, what="dp scraped")
            got = report()
            assert got is not None
            assert got["capacity_tokens"] == 640_000
            assert got["engines"] == 2
