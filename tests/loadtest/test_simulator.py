"""The offline fleet simulator: small seeded runs (seconds) that show the problem and the fix."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest.local_fleet import free_port
from loadtest.sim.engine import SimConfig, SimResult, simulate
from loadtest.sim.runner import WorkloadSpec, at_load
from loadtest.sim.simulator import duration, main
from loadtest.sim.tune import main as tune_main
from loadtest.sim.workload import HoldModel, parse_mix, trace_stream
from proxy.config import parse_config
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

TRACE = (
    Path(__file__).resolve().parents[2] / "loadtest" / "data" / "AzureLLMInferenceTrace_code.csv"
)
HOUR = 3_600.0

# 6 contiguous nodes (5 in kvroute's long pool), the problem statement's 70/30 mix at 55% KV load.
BASE = SimConfig(nodes=6, long_pool=5, hold=HoldModel(0.002, 0.5, 600.0), seed=7)
SPEC = at_load(WorkloadSpec(seed=7), BASE, 0.55)


def run(
    policy: str, cfg: SimConfig = BASE, spec: WorkloadSpec = SPEC, dur: float = 2 * HOUR
) -> SimResult:
    return simulate(cfg, policy, spec.stream(dur, cfg.settings.long_threshold_tokens), dur)


@pytest.fixture(scope="module")
def contiguous() -> dict[str, SimResult]:
    return {p: run(p) for p in ("round_robin", "kvroute", "oracle")}


def test_round_robin_fails_with_memory_free(contiguous: dict[str, SimResult]) -> None:
    rr = contiguous["round_robin"]
    assert rr.requests > 10_000
    assert rr.false_capacity_failures >= 20  # failures while the fleet was > 25% free
    assert rr.failed_attempts > rr.failures  # each failure wasted several attempts
    assert rr.long_failure_rate > rr.failure_rate  # it is the long requests that do not fit


def test_kvroute_fails_far_less_than_round_robin(contiguous: dict[str, SimResult]) -> None:
    rr, kv = contiguous["round_robin"], contiguous["kvroute"]
    assert kv.requests == rr.requests  # the same request stream
    assert kv.failures <= 0.2 * rr.failures
    assert kv.false_capacity_failures <= 0.2 * rr.false_capacity_failures
    assert (
        kv.failed_attempts <= 0.05 * rr.failed_attempts
    )  # fit check: it does not send doomed requests


def test_oracle_bounds_kvroute(contiguous: dict[str, SimResult]) -> None:
    kv, oracle = contiguous["kvroute"], contiguous["oracle"]
    assert oracle.failures <= kv.failures
    assert oracle.mean_fragmentation == 0.0
    assert oracle.failed_attempts == 0


def test_restarts_reduce_round_robin_failures() -> None:
    # Sessions that keep KV resident pin the address space, so fragmentation grows with
    # uptime; a rolling restart every 30 minutes of uptime resets it.
    cfg = replace(
        BASE,
        nodes=4,
        long_pool=3,
        hold=HoldModel(0.05, 0.5, 300.0, 86_400.0),
        restart_downtime_s=30.0,
        drain_timeout_s=60.0,
        seed=3,
    )
    spec = at_load(WorkloadSpec(seed=3), cfg, 0.45)
    dur = 3 * HOUR
    plain = run("round_robin", cfg, spec, dur)
    restarted = run(
        "round_robin", replace(cfg, restart="uptime", restart_uptime_s=1_800.0), spec, dur
    )
    assert restarted.restarts >= 10
    assert plain.restarts == 0
    assert restarted.failures < 0.85 * plain.failures


def test_fragmentation_triggered_restarts_happen_one_at_a_time() -> None:
    cfg = replace(
        BASE,
        restart="frag",
        restart_frag=0.3,
        restart_frag_for_s=120.0,
        restart_min_interval_s=600.0,
        restart_downtime_s=60.0,
    )
    r = run("round_robin", cfg, dur=HOUR)
    assert r.restarts >= 1
    down_at_once = [
        sum(1 for v in r.series_uptime.values() if v[i] == 0.0) for i in range(len(r.series_t))
    ]
    assert max(down_at_once) <= 1


def test_paged_allocators_have_almost_no_fragmentation_failures(
    contiguous: dict[str, SimResult],
) -> None:
    cfg = replace(BASE, allocator="paged", block_size=16)
    paged_rr = run("round_robin", cfg)
    contiguous_rr = contiguous["round_robin"]
    assert paged_rr.mean_fragmentation == 0.0
    # What round robin still fails on paged nodes is blind placement on a full node, not
    # fragmentation: far fewer failures with memory free, and a fit-checking policy has none.
    assert paged_rr.false_capacity_failures <= 0.15 * contiguous_rr.false_capacity_failures
    assert paged_rr.failures <= 0.5 * contiguous_rr.failures
    assert run("kvroute", cfg).failures <= 2


@pytest.mark.skipif(not TRACE.exists(), reason="Azure trace not present")
def test_trace_replay_runs() -> None:
    reqs = list(trace_stream(TRACE, 600.0, length_scale=4.0, rate_scale=2.0))
    assert reqs and all(a.arrival_s <= b.arrival_s for a, b in pairwise(reqs))
    assert max(r.prompt_tokens for r in reqs) > 20_000  # x4: the trace's 7.4k prompts become long
    spec = at_load(WorkloadSpec(kind="trace", trace=str(TRACE), length_scale=4.0), BASE, 0.5)
    r = run("kvroute", BASE, spec, dur=900.0)
    assert r.requests > 500
    assert r.long_requests > 0
    assert r.utilisation > 0.1


def test_trace_loops_past_its_end() -> None:
    if not TRACE.exists():
        pytest.skip("Azure trace not present")
    reqs = list(trace_stream(TRACE, 7_200.0, rate_scale=1.0))
    assert reqs[-1].arrival_s > 3_500.0 * 1.5  # the ~57 minute trace played more than once


def test_json_output_has_the_fields(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    plots = tmp_path / "plots"
    rc = main(
        [
            "--quick", "--nodes", "4", "--duration", "20m", "--policies", "kvroute,round_robin,oracle",
            "--replicas", "--replicas-duration", "10m", "--max-nodes", "8",
            "--json", str(out), "--json-series", "--plots", str(plots), "--no-progress", "--jobs", "1",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"config", "workload", "duration_s", "results", "replicas", "headline"}
    assert set(doc["results"]) == {"kvroute", "round_robin", "oracle"}
    for res in doc["results"].values():
        for key in (
            "requests", "failures", "failure_rate", "failed_attempts", "false_capacity_failures",
            "long_failure_rate", "mean_fragmentation", "restarts", "utilisation", "queued", "series",
        ):  # fmt: skip
            assert key in res, key
        assert res["requests"] > 0
        assert set(res["series"]["fragmentation"]) == {"n0", "n1", "n2", "n3"}
    for rep in doc["replicas"].values():
        assert rep["needed"] is None or 1 <= rep["needed"] <= 8
        assert rep["probes"]
    assert doc["config"]["nodes"] == 4
    names = sorted(p.name for p in plots.iterdir())
    assert names == sorted(
        [
            "sim_fragmentation_vs_uptime.png",
            "sim_largest_vs_free.png",
            "sim_failures_over_time.png",
            "sim_replicas_needed.png",
        ]
    )
    assert all(0 < (plots / n).stat().st_size < 150_000 for n in names)


def test_cli_rejects_bad_input() -> None:
    with pytest.raises(SystemExit):
        main(["--policies", "random", "--no-progress"])
    with pytest.raises(SystemExit):
        main(["--duration", "soon", "--no-progress"])
    with pytest.raises(ValueError):
        parse_mix("short:0.7:500-20:1-2")
    assert duration("6d") == 6 * 86_400
    assert duration("90") == 90.0
    assert duration("1.5h") == 5_400.0


def test_tune_recommends_a_valid_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "kvroute.yaml"
    conf.write_text(
        f"listen: {{port: {free_port()}}}\n"  # no gateway there: the capacity is assumed
        "pools: {general: {role: general}, long: {role: long}}\n"
        "backends:\n"
        "  - {name: a, url: 'http://127.0.0.1:9001', pool: long, kind: contiguous}\n"
        "  - {name: b, url: 'http://127.0.0.1:9002', pool: general, kind: contiguous}\n"
        "  - {name: c, url: 'http://127.0.0.1:9003', pool: general, kind: contiguous}\n"
    )
    out = tmp_path / "tune.json"
    rc = tune_main(
        [
            "--config",
            str(conf),
            "--duration",
            "15m",
            "--hold-min",
            "600",
            "--jobs",
            "1",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for knob in ("long_pool", "long_threshold_tokens", "safety_margin", "restart", "all together"):
        assert knob in text
    # Where the capacity came from is said; each recommendation comes with its measured effect.
    assert "capacity per node from ASSUMED" in text
    why = text.split("Why each recommendation", 1)[1].split("Recommended config", 1)[0]
    for knob in ("long_pool", "long_threshold_tokens", "safety_margin", "restart"):
        assert re.search(rf"- {knob}: (keep \S+: |\S+ -> \S+: )", why), why
    assert "- all recommendations together: " in why
    snippet = text.split("paste into your kvroute YAML):", 1)[1]
    cfg = parse_config(yaml.safe_load(snippet))  # what it recommends is a config kvroute accepts
    assert [b.name for b in cfg.backends] == ["a", "b", "c"]
    assert any(cfg.pool_role(b.pool) == "long" for b in cfg.backends)
    doc = json.loads(out.read_text())
    assert {c["knob"] for c in doc["candidates"]} >= {
        "current",
        "long_pool",
        "safety_margin",
        "restart",
        "combined",
    }
    assert tune_main(["--config", str(tmp_path / "missing.yaml"), "--no-progress"]) == 2


def test_tune_reads_capacity_from_config_then_live_fleet(
    tmp_path: Path, engine_factory: Callable[..., Any]
) -> None:
    from loadtest.sim.tune import capacity_for, parser

    a = parser().parse_args(["--config", "x"])
    with_caps = parse_config(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "capacity_tokens": 90_000}]}
    )
    assert capacity_for(with_caps, a, set()) == (
        90_000,
        "the config's backends[].capacity_tokens (median)",
    )
    engine = engine_factory(name="e", capacity_tokens=100_000)
    cfg = gateway_cfg([{"name": "e", "url": engine.url, "kind": "contiguous"}])
    with run_gateway(cfg) as url:
        wait_until(lambda: fleet_state(url)["backends"][0]["report"] is not None)
        a.fleet = url
        cap, source = capacity_for(cfg, a, set())
    assert cap == 100_000 and source.startswith(url)
    # An explicit --capacity wins over everything.
    a.capacity = 50_000
    assert capacity_for(with_caps, a, {"--capacity"})[0] == 50_000
