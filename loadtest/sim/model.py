"""What a simulation is given (``SimConfig``) and what it gives back (``SimResult``).

Plain data, kept apart from the event loop in ``loadtest.sim.engine`` so that the report,
plot and tune modules can read results without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadtest.sim.workload import HoldModel
from proxy.config import QueueConfig, RetryConfig
from proxy.routing.policy import PolicySettings

POLICY_NAMES = ("kvroute", "round_robin", "least_loaded", "most_free", "oracle")
RESTART_MODES = ("none", "uptime", "frag")
HIGH_FREE = 0.25  # the problem statement's "failure while > 25% free" line
# The gateway's own defaults, from the config model rather than retyped.
_RETRY, _QUEUE = RetryConfig(), QueueConfig()


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything about the fleet and the gateway that a run depends on."""

    nodes: int = 8
    long_pool: int = 6  # nodes with role "long" (ignored by the baselines, as peers ignore pools)
    capacity_tokens: int = 131_072
    allocator: str = "contiguous"
    block_size: int = 16
    prefill_tps: float = 10_000.0  # prompt tokens per second per request
    decode_tps: float = 30.0  # output tokens per second per sequence
    max_concurrency: int = 0  # per node; 0 = unlimited
    max_attempts: int = _RETRY.max_attempts  # gateway: candidates tried per request
    client_retries: int = 0  # blind client retries after a final failure
    client_retry_delay_s: float = 2.0
    report_lag_s: float = 0.0  # 0: every decision sees fresh reports; else scraped every lag s
    ceiling_ttl_s: float = _RETRY.ceiling_ttl_s
    queue_wait_s: float = (
        _QUEUE.max_wait_s
    )  # queue.max_wait_s: a request nothing fits waits this long for room
    queue_max: int = _QUEUE.max_size  # queue.max_size
    settings: PolicySettings = field(default_factory=PolicySettings)
    hold: HoldModel = field(default_factory=HoldModel)
    restart: str = "none"
    restart_uptime_s: float = 6 * 86_400.0
    # The gateway's maintenance loop (maintenance.* in the config, same defaults):
    restart_frag: float = 0.5  # 1 - restart_below_ratio: fragmentation that triggers a restart ...
    restart_frag_for_s: float = 300.0  # ... restart_after_s: when sustained this long
    restart_min_free: float = (
        0.1  # ... min_free_fraction: while this much is free (fragmented, not full)
    )
    restart_min_interval_s: float = 3_600.0  # min_interval_per_node_s
    restart_downtime_s: float = 120.0  # process restart until it serves again
    drain_timeout_s: float = 300.0  # then what is left (retained session KV) is dropped
    sample_s: float = 60.0
    series_s: float = 900.0
    seed: int = 1

    def node_names(self) -> list[str]:
        width = len(str(self.nodes))
        return [f"n{i:0{width}d}" for i in range(self.nodes)]


@dataclass
class SimResult:
    """Counters, time averages and time series of one run (``to_dict`` is the JSON form)."""

    policy: str
    config: SimConfig
    duration_s: float = 0.0
    requests: int = 0
    long_requests: int = 0
    failures: int = 0  # requests that failed for good (after any client retries)
    long_failures: int = 0
    gateway_failures: int = 0  # every arrival (client retries included) that found no node
    false_capacity_failures: int = 0  # final failures while the fleet was > 25% free
    failed_attempts: int = 0  # every node that rejected an allocation
    attempts_high_free: int = 0  # ... while that node was > 25% free
    busy_attempts: int = 0  # rejected by the concurrency limit
    client_retries: int = 0
    queued: int = 0  # requests that waited in the admission queue
    queue_served: int = 0  # ... and then got a node in time
    queue_wait_s: float = 0.0  # total wait of those
    restarts: int = 0
    evicted: int = 0  # retained KV dropped by a drain timeout
    frag_sum: float = 0.0
    util_sum: float = 0.0
    samples: int = 0
    served_tokens: int = 0
    series_t: list[float] = field(default_factory=list)
    series_frag: dict[str, list[float]] = field(default_factory=dict)
    series_free: dict[str, list[int]] = field(default_factory=dict)
    series_largest: dict[str, list[int]] = field(default_factory=dict)
    series_uptime: dict[str, list[float]] = field(default_factory=dict)
    series_failures: list[int] = field(default_factory=list)  # failures in each series bucket
    series_requests: list[int] = field(default_factory=list)

    @property
    def failure_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def long_failure_rate(self) -> float:
        return self.long_failures / self.long_requests if self.long_requests else 0.0

    @property
    def mean_fragmentation(self) -> float:
        return self.frag_sum / self.samples if self.samples else 0.0

    @property
    def utilisation(self) -> float:
        return self.util_sum / self.samples if self.samples else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "nodes": self.config.nodes,
            "long_pool": self.config.long_pool if self.policy == "kvroute" else 0,
            "allocator": self.config.allocator,
            "duration_s": self.duration_s,
            "requests": self.requests,
            "failures": self.failures,
            "failure_rate": self.failure_rate,
            "gateway_failures": self.gateway_failures,
            "failed_attempts": self.failed_attempts,
            "false_capacity_failures": self.false_capacity_failures,
            "attempts_high_free": self.attempts_high_free,
            "busy_attempts": self.busy_attempts,
            "long_requests": self.long_requests,
            "long_failures": self.long_failures,
            "long_failure_rate": self.long_failure_rate,
            "client_retries": self.client_retries,
            "queued": self.queued,
            "queue_served": self.queue_served,
            "mean_queue_wait_s": self.queue_wait_s / self.queue_served
            if self.queue_served
            else 0.0,
            "mean_fragmentation": self.mean_fragmentation,
            "utilisation": self.utilisation,
            "restarts": self.restarts,
            "evicted": self.evicted,
        }

    def to_dict(self, series: bool = False) -> dict[str, Any]:
        d = self.summary()
        if series:
            d["series"] = {
                "t": self.series_t,
                "fragmentation": self.series_frag,
                "free_tokens": self.series_free,
                "largest_free_block_tokens": self.series_largest,
                "uptime_s": self.series_uptime,
                "failures": self.series_failures,
                "requests": self.series_requests,
            }
        return d
