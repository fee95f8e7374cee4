"""`kvroute local-fleet` and LocalFleet leave nothing behind: no engine, no temp folder.

Real processes throughout: a hangup (the terminal closed) and a SIGKILL of the parent, a
port already taken, an engine that cannot start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loadtest.local_fleet import EngineSpec, LocalFleet, free_port
from tests.support.gateway import wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's"
)


# tiktoken keeps its files under TMPDIR unless told otherwise: keep using the shared copy.
TOKENIZER_CACHE = {
    "TIKTOKEN_CACHE_DIR": os.environ.get("TIKTOKEN_CACHE_DIR")
    or os.path.join(tempfile.gettempdir(), "data-gym-cache")
}


def ours(tmp: Path) -> list[str]:
    """The kvroute-* temp folders under ``tmp``."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("kvroute-")]


def engine_pids(ports: list[int]) -> list[int]:
    """Simulated engines listening on these ports, found by their command lines in /proc."""
    wanted = {f"--port\0{p}\0".encode() for p in ports}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"loadtest.engine.server" in cmd and any(w in cmd for w in wanted):
            found.append(int(entry.name))
    return found


def two_engine_config(path: Path, ports: list[int]) -> Path:
    path.write_text(
        "pools: {general: {}}\n"
        "backends:\n"
        + "".join(
            f"  - {{name: e{i}, url: 'http://127.0.0.1:{p}', kind: contiguous}}\n"
            for i, p in enumerate(ports)
        )
    )
    return path


@contextmanager
def local_fleet_cli(tmp_path: Path, ports: list[int]) -> Iterator[subprocess.Popen[str]]:
    """`kvroute local-fleet` with its own TMPDIR (so its temp folders can be counted)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cfg = two_engine_config(tmp_path / "k.yaml", ports)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "local-fleet", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), **TOKENIZER_CACHE},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        for pid in engine_pids(ports):
            os.kill(pid, signal.SIGKILL)


def wait_ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("ready:"):
            return "".join(seen)
    raise AssertionError("".join(seen))


def test_a_hangup_stops_every_engine_and_removes_the_logs(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    with local_fleet_cli(tmp_path, ports) as proc:
        wait_ready(proc)
        assert len(engine_pids(ports)) == 2
        assert [n[:20] for n in ours(tmp_path / "tmp")] == ["kvroute-local-fleet-"]
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 0
        assert engine_pids(ports) == []
        assert ours(tmp_path / "tmp") == []


def test_a_killed_local_fleet_takes_its_engines_with_it(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    with local_fleet_cli(tmp_path, ports) as proc:
        wait_ready(proc)
        proc.kill()
        proc.wait(timeout=30)
        # The kernel's parent-death signal, not any code of the dead parent, ends them.
        wait_until(lambda: engine_pids(ports) == [], timeout_s=30, what="engines gone")


def test_a_port_in_use_is_named_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [free_port(), taken.getsockname()[1]]
        with local_fleet_cli(tmp_path, ports) as proc:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 1, out
    assert f"port in use for e1 (port {ports[1]})" in out
    assert "ready:" not in out
    assert engine_pids(ports) == []


def test_an_engine_that_cannot_start_says_why_from_its_log(tmp_path: Path) -> None:
    fleet = LocalFleet([EngineSpec("broken", extra=("--no-such-flag",))], workdir=tmp_path / "work")
    fleet.workdir.mkdir()
    with pytest.raises(RuntimeError) as err:
        fleet.start_engines()
    fleet.stop()
    message = str(err.value)
    assert message.startswith("broken: process for http://127.0.0.1:")
    assert "unrecognized arguments: --no-such-flag" in message
    assert not fleet.workdir.exists()


def test_local_fleet_removes_its_temp_folder_on_stop() -> None:
    with LocalFleet([EngineSpec("e0", speedup=50)], policy="round_robin") as fleet:
        workdir = fleet.workdir
        assert workdir.name.startswith("kvroute-fleet-") and (workdir / "e0.log").exists()
    assert not workdir.exists()


def test_a_callers_own_folder_is_kept(tmp_path: Path) -> None:
    fleet = LocalFleet([], workdir=tmp_path, remove_workdir=False)
    fleet.stop()
    assert tmp_path.exists()
