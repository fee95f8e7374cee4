"""The documented contract between kvroute and the backends it routes to.

Custom inference servers export these gauges on ``/metrics`` (or push the Redis hash
described in the README) so kvroute can see their allocator; the simulated engine exports
them too. Paged servers may instead export vLLM's own metric names, listed here as well.
The allocation-failure error is what the gateway recognises as "this node cannot fit this
request now" and diverts to another node.
"""

from __future__ import annotations

# --- kvroute allocator gauges (tokens) -------------------------------------------------
CAPACITY = "kvroute_engine_kv_capacity_tokens"
FREE = "kvroute_engine_kv_free_tokens"
LARGEST_FREE_BLOCK = "kvroute_engine_kv_largest_free_block_tokens"
ALLOCATOR_INFO = (
    "kvroute_engine_allocator_info"  # labels: allocator="contiguous|paged", block_size="16"
)
START_TIME = "kvroute_engine_start_time_seconds"  # unix time of the last (re)start
RUNNING = "kvroute_engine_requests_running"
WAITING = "kvroute_engine_requests_waiting"
ALLOCATION_FAILURES = "kvroute_engine_allocation_failures_total"

# --- vLLM's names (what a real vLLM server exports) ---------------------------------------
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # 0..1
VLLM_KV_USAGE_DEPRECATED = "vllm:gpu_cache_usage_perc"  # older vLLM releases
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # labels include block_size, num_gpu_blocks
VLLM_START_TIME = "process_start_time_seconds"

# --- the allocation-failure error --------------------------------------------------------
# HTTP 503 with an OpenAI-style body whose error.type is this string, plus the numbers:
#   {"error": {"message": "...", "type": "kv_cache_allocation_error",
#              "code": "kv_cache_allocation_failed", "param": null,
#              "demand_tokens": 22000, "free_tokens": 38000, "largest_free_block_tokens": 1200}}
ALLOCATION_ERROR_STATUS = 503
ALLOCATION_ERROR_TYPE = "kv_cache_allocation_error"
ALLOCATION_ERROR_CODE = "kv_cache_allocation_failed"
