"""Optional parts say how to install them: locust (`kvroute[loadtest]`), plots (`kvroute[sim]`).

A fresh `pip install kvroute` has neither; each entry point must name the extra instead of
ending in a bare ModuleNotFoundError. The missing package is simulated by blocking its import.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``import <module>`` fails."""
    prelude = f"import sys; sys.modules[{module!r}] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def test_locustfile_without_locust_names_the_extra() -> None:
    res = run_without(
        "locust",
        "import runpy; runpy.run_module('loadtest.bench.locustfile', run_name='__main__')",
    )
    assert res.returncode == 1
    assert "pip install 'kvroute[loadtest]'" in res.stderr
    assert "Traceback" not in res.stderr


def test_simulate_plots_without_matplotlib_fail_before_the_run() -> None:
    res = run_without(
        "matplotlib",
        "from loadtest.sim.simulator import main; raise SystemExit(main(['--plots', 'x', '--duration', '30d']))",
    )
    # Refused at once (a 30-day run would take minutes), with the extra named.
    assert res.returncode == 2
    assert "pip install 'kvroute[sim]'" in res.stderr


def test_plots_module_names_the_extra() -> None:
    res = run_without("matplotlib", "import loadtest.sim.plots")
    assert res.returncode == 1
    assert "pip install 'kvroute[sim]'" in res.stderr


def test_pd_floor_without_scipy_names_the_extra() -> None:
    res = run_without("scipy", "import loadtest.lab.pd_floor")
    assert res.returncode == 1
    assert "pip install 'kvroute[loadtest]'" in res.stderr
    assert "Traceback" not in res.stderr


def test_gateway_install_has_no_plotting_stack() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    for heavy in ("matplotlib", "pillow", "locust", "scipy"):
        assert heavy not in core
    # numpy is the gateway's own since its prefix block hashes are vectorized (issue 12).
    assert "numpy" in core
    extras = project["optional-dependencies"]
    assert any("matplotlib" in d for d in extras["sim"])
    assert any("locust" in d for d in extras["loadtest"])
    assert any("scipy" in d for d in extras["loadtest"])
    # CI installs .[dev]: it must pull both, so the whole suite still runs.
    assert "kvroute[sim,loadtest,epp]" in extras["dev"]
    assert all(d.split(">")[0] not in core for d in extras["epp"])


def test_epp_without_grpc_names_the_extra() -> None:
    res = run_without(
        "grpc", "from proxy.epp.main import main; raise SystemExit(main(['--config', 'x']))"
    )
    assert res.returncode == 2
    assert "pip install 'kvroute[epp]'" in res.stderr
    assert "Traceback" not in res.stderr
