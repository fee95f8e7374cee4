"""A smoke run of ``python -m loadtest.bench epp`` with tiny parameters, so it never rots.

Real processes behind it: trivial backends, ``kvroute epp`` with an Envoy in front, and
``kvroute serve``. Needs Envoy (skipped without it, failed under ``KVROUTE_REQUIRE_ENVOY``)
and wrk. Nothing here asserts on speed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.loadtest.test_bench_scripts import load, run_bench
from tests.support.envoy import require_envoy

pytestmark = pytest.mark.timeout(420)


def test_bench_epp_smoke(tmp_path: Path) -> None:
    require_envoy()
    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed")
    out_json = tmp_path / "epp.json"
    out = run_bench(
        "epp",
        "--duration", "1", "--concurrency", "4", "--bodies", "2", "--doc-chars", "20000",
        "--no-vllm-router", "--json", str(out_json),
    )  # fmt: skip
    res = load(out_json)
    assert "req/s" in out.stdout
    for case in ("tiny", "big"):
        rows = {r["target"]: r for r in res["load"][case]}
        assert set(rows) == {"envoy+kvroute-epp", "envoy+bare-ext-proc", "kvroute"}, case
        for r in rows.values():
            assert r["requests"] > 0 and r["errors"] == 0 and r["cpu_ms_per_req"] > 0, (case, r)
    assert set(res["epp_vs_gateway"]) == {"tiny", "big"}
