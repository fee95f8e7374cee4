"""Smoke runs of the benchmark scripts with tiny parameters, so they never rot.

Each script runs as a user would run it (a subprocess, real processes behind it) and must
write its JSON with every field the docs rely on. Nothing here asserts on speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each smoke run starts engines, a gateway and sometimes a peer router for a few seconds of load:
# quick on a quiet machine, minutes on a loaded 2-core one. The bounds catch a hang, nothing else.
pytestmark = pytest.mark.timeout(420)


def run_module(module: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, f"{module} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def run_bench(
    subcommand: str, *args: str, timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    """A benchmark as users start it: ``python -m loadtest.bench <subcommand> ...``."""
    return run_module("loadtest.bench", subcommand, *args, timeout=timeout)


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_bench_overhead_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "overhead.json"
    out = run_bench(
        "overhead",
        "--duration", "0.5", "--concurrency", "2", "--modes", "json,sse", "--stream-chunks", "8",
        "--loadgen", "python", "--no-redis", "--no-vllm-router",
        "--long-requests", "2",
        "--json", str(out_json),
    )  # fmt: skip
    res = load(out_json)
    assert res["loadgen"] == "python"
    assert "req/s" in out.stdout
    by_key = {(p["target"], p["mode"]): p for p in res["points"]}
    targets = ("direct", "kvroute", "bare-aiohttp-proxy")
    assert set(by_key) == {(t, m) for t in targets for m in ("json", "sse")}
    for (target, mode), p in by_key.items():
        assert p["requests"] > 0 and p["rps"] > 0, p
        assert p["errors"] == 0, p
        assert p["p50_ms"] > 0 and p["p99_ms"] >= p["p50_ms"], p
        assert p["rps_ratio_vs_direct"] is not None and p["p50_added_ms"] is not None
        assert (p["router_cpu_us_per_req"] is None) == (target == "direct"), p
        if mode == "sse":
            assert p["events_per_response"] == 8 + 1  # 8 chunks and [DONE], relayed whole
            assert p["events_per_s"] > 0
    # The figures: throughput against the bare proxy, the 30k-token decision, loop lag.
    assert res["summary"]["json c=2"]["x_bare-aiohttp-proxy"] > 0
    assert res["summary"]["sse c=2"]["events_x_bare-aiohttp-proxy"] > 0
    decision = res["extras"]["decision"]
    assert decision["decision_ms_p50_alone"] > 0 and decision["loop_lag_ms_p99"] >= 0
    assert "== summary" in out.stdout


def test_wrk_generator_reads_its_summary(tmp_path: Path) -> None:
    """The wrk path (used when wrk is installed) parses wrk's Lua summary into a Load."""
    from loadtest.bench.overhead import find_wrk, request_body, run_wrk
    from loadtest.local_fleet import Proc, free_port, wait_http

    wrk = find_wrk()
    if wrk is None:
        pytest.skip("wrk is not installed")
    port = free_port()
    backend = Proc(
        "backend",
        [sys.executable, "-m", "loadtest.engine.trivial", "--port", str(port)],
        f"http://127.0.0.1:{port}",
    )
    backend.start(log_dir=tmp_path)
    try:
        wait_http(backend.url + "/health", proc=backend.popen)
        load = run_wrk(
            wrk, backend.url + "/v1/chat/completions", request_body(False), 2, 1.0, tmp_path
        )
    finally:
        backend.stop()
    assert load.requests > 0 and load.errors == 0
    assert load.duration_s > 0.5 and load.rps > 0
    assert 0 < load.p50_ms <= load.p99_ms


def test_bench_routing_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "routing.json"
    run_bench(
        "routing",
        "--min-time",
        "0.02",
        "--lag-prompts",
        "2",
        "--lag-concurrency",
        "1",
        "--json",
        str(out_json),
    )
    res = load(out_json)
    rows = {r["prompt_tokens"]: r for r in res["decisions"]}
    assert set(rows) == {200, 2_000, 30_000}
    for size, r in rows.items():
        assert abs(r["counted_tokens"] - size) <= 2, r  # make_prompt builds exact token counts
        for key in (
            "parse_orjson_us",
            "tokenize_inline_us",
            "tokenize_async_us",
            "rank_kvroute_us",
            "rank_round_robin_us",
            "decision_us",
        ):
            assert r[key] > 0, (key, r)
    assert rows[200]["decision_x_200"] == pytest.approx(1.0)
    assert rows[200]["class"] == "short" and rows[30_000]["class"] == "long"
    assert rows[30_000]["off_loop"] and not rows[200]["off_loop"]
    lag = res["loop_lag"]
    for mode in ("idle", "inline", "off_loop"):
        assert lag[mode]["ticks"] > 0 and lag[mode]["lag_max_ms"] is not None
    assert res["thread_hop_us"] > 0


def test_compare_e2e_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "e2e.json"
    out = run_bench(
        "compare",
        "--requests", "8", "--rate", "20", "--speedup", "200", "--capacity-tokens", "60000", "--seed", "3",
        "--long-engines", "1", "--general-engines", "1",
        "--json", str(out_json),
    )  # fmt: skip
    res = load(out_json)
    assert [r["policy"] for r in res["runs"]] == ["round_robin", "kvroute"]
    for r in res["runs"]:
        assert r["requests"] == 8
        assert r["ok"] + r["final_failures"] == 8
        assert r["long_requests"] + r["short_requests"] == 8
        for key in (
            "engine_allocation_failures",
            "false_capacity_failures",
            "goodput_tokens_per_s",
            "retries_diverted",
        ):
            assert r[key] >= 0, (key, r)
        assert set(r["gateway_allocation_failures"]) == {"fragmentation", "capacity"}
        assert set(r["latency_s"]) == {"p50", "p90", "p99"}
        assert r["ok"] == 0 or r["latency_s"]["p50"] > 0
    assert "change" in res
    assert "round_robin" in out.stdout and "kvroute" in out.stdout


def test_bench_big_prompts_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "big.json"
    out = run_module(
        "loadtest.bench.big_prompts",
        "--duration", "1", "--concurrency", "4", "--tiny-concurrency", "2", "--bodies", "4",
        "--doc-chars", "20000", "--lone", "2", "--workers", "1", "--no-vllm-router", "--warm",
        "--json", str(out_json),
    )  # fmt: skip
    res = load(out_json)
    assert "req/s" in out.stdout
    for case in ("shared", "unique", "tiny_c2", "tiny_c1"):
        rows = {r["target"]: r for r in res["load"][case]}
        assert set(rows) == {"direct", "kvroute"}, case
        for r in rows.values():
            assert r["requests"] > 0 and r["errors"] == 0 and r["cpu_ms_per_req"] > 0, (case, r)
    for case in ("same", "repeat", "fresh"):
        lone = res["lone"][case]
        assert lone["added_p50_ms"]["direct"] == 0 and "kvroute" in lone["added_p50_ms"]
        assert lone["requests"] == 2


def test_bench_sizing_smoke() -> None:
    out = run_bench("sizing", "--trace-limit", "20", "--repeat", "2").stdout
    for line in ("## 30k-token prompt", "with cache:", "model / cl100k =", "NOT a real model's"):
        assert line in out, out


def test_bench_queueing_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "q.json"
    run_bench(
        "queueing",
        "--runs", "1", "--duration", "2", "--rate", "4", "--policies", "kvroute,round_robin",
        "--json", str(out_json),
    )  # fmt: skip
    rows = json.loads(out_json.read_text())
    assert [r["policy"] for r in rows] == ["kvroute", "round_robin"]
    for r in rows:
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert r["short_ttft_p50"] is not None and r["preemptions"] >= 0
        assert r["output_tokens_per_s"] > 0


def test_the_bench_entry_lists_every_subcommand_and_refuses_others() -> None:
    from loadtest.bench.__main__ import SUBCOMMANDS

    out = run_module("loadtest.bench", "--help").stdout
    for name in SUBCOMMANDS:
        assert f"  {name} " in out, out
    wrong = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", "nope"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert wrong.returncode == 2 and "unknown subcommand 'nope'" in wrong.stderr


def test_every_subcommand_is_a_module_with_main_and_documented() -> None:
    from loadtest.bench.__main__ import SUBCOMMANDS

    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for name, (module, _) in SUBCOMMANDS.items():
        # Read, not imported: the locustfile monkeypatches the process (gevent) on import.
        source = (ROOT / "loadtest" / "bench" / f"{module}.py").read_text()
        assert "\ndef main(argv" in source, name
        assert f"python -m loadtest.bench {name}" in docs, name


def test_bench_pd_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "pd.json"
    run_module(
        "loadtest.bench.pd",
        "--duration", "2", "--rate", "3", "--speedup", "20", "--routers", "kvroute",
        "--ask", "300", "5000", "--set", "memory_pressure.max_overtakes=0",
        "--min-uncached", "0", "--json", str(out_json),
    )  # fmt: skip
    (row,) = json.loads(out_json.read_text())
    assert row["router"] == "kvroute" and row["requests"] > 0 and row["failed"] == 0, row
    assert row["decode_preemptions"] >= 0 and row["ttft_p99"] is not None
    assert set(row["decode_kv_mean"]) == {"d0", "d1"} and row["prefill_held_at_end"] == 0
    # Every request took two steps: the slowest ones' time, part by part (Server-Timing).
    parts = row["slowest"]
    assert parts is not None and parts["prefill"] > 0, parts
    assert parts["decode_sent"] >= parts["hold"] and parts["ttft"] >= parts["decode_sent"]


def test_bench_pd_sglang_smoke(tmp_path: Path) -> None:
    # SGLang's protocol: SGLang-dialect servers with bootstrap rooms; the peer (sglang-router)
    # is not installed here, so kvroute only.
    out_json = tmp_path / "pd.json"
    run_module(
        "loadtest.bench.pd",
        "--protocol", "sglang", "--duration", "2", "--rate", "3", "--speedup", "20",
        "--routers", "kvroute", "--json", str(out_json),
    )  # fmt: skip
    (row,) = json.loads(out_json.read_text())
    assert row["router"] == "kvroute" and row["requests"] > 0 and row["failed"] == 0, row
    # No room left open on a prefill server; both decode servers sampled.
    assert row["prefill_held_at_end"] == 0 and set(row["decode_kv_mean"]) == {"d0", "d1"}
    # Both halves leave at once (no step 1 before step 2): the parts still add up.
    parts = row["slowest"]
    assert parts is not None and parts["prefill"] == 0.0, parts
    assert parts["decode_sent"] >= parts["hold"] and parts["ttft"] >= parts["decode_sent"], parts


@pytest.mark.parametrize("model", ["classic", "v1"])
def test_bench_pd_engine_model_smoke(tmp_path: Path, model: str) -> None:
    # The do-no-harm engine models in their P/D roles, kvroute untuned in front of them.
    out_json = tmp_path / "pd.json"
    run_module(
        "loadtest.bench.pd",
        "--engine-model", model, "--duration", "2", "--rate", "3", "--speedup", "20",
        "--routers", "kvroute", "--json", str(out_json),
    )  # fmt: skip
    (row,) = json.loads(out_json.read_text())
    assert row["engine_model"] == model and row["router"] == "kvroute", row
    assert row["requests"] > 0 and row["failed"] == 0, row
    assert row["prefill_held_at_end"] == 0 and set(row["decode_kv_mean"]) == {"d0", "d1"}


def test_bench_continuation_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "c.json"
    run_module(
        "loadtest.bench.continuation",
        "--duration", "3", "--rate", "3", "--kill-at", "1", "--down", "0.5",
        "--systems", "kvroute", "--json", str(out_json),
    )  # fmt: skip
    rows = load(out_json)["rows"]
    assert [r["system"] for r in rows] == ["kvroute"]
    row = rows[0]
    assert row["streams"] > 0 and 0 <= row["completed"] <= row["streams"]
    for key in ("completed_pct", "continued", "added_p50_s", "added_p99_s", "failures", "gateway"):
        assert key in row, key
