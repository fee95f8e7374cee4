"""One drain time, the same everywhere it is stated: config default, CLI, image, Compose, Kubernetes.

Each orchestrator's grace period must cover the drain plus the last events' close
(proxy.api.drain.CLOSE_GRACE_S), or it kills the gateway before the drain ends.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from proxy.api.drain import CLOSE_GRACE_S
from proxy.cli import build_parser
from proxy.config import ShutdownConfig, parse_config

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = ShutdownConfig().drain_s


def test_the_default_drain_covers_a_whole_stream() -> None:
    cfg = parse_config({"backends": [{"name": "b", "url": "http://x:1"}]}, environ={})
    assert DRAIN_S == 600 and cfg.shutdown.drain_s >= cfg.upstream.total_timeout_s


def test_the_cli_states_the_same_default() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    (action,) = [a for a in serve._actions if a.dest == "drain_s"]
    assert action.default is None  # None: the config's shutdown.drain_s
    assert f"{DRAIN_S:g}" in (action.help or "")


def test_the_image_states_it_and_stops_gracefully() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    label = re.search(r'io\.kvroute\.shutdown\.drain-seconds="(\d+)"', dockerfile)
    assert label is not None and float(label.group(1)) == DRAIN_S
    assert f"docker stop -t {int(DRAIN_S + CLOSE_GRACE_S + 5)}" in dockerfile
    assert re.search(r"^HEALTHCHECK .*\n?.*/ready", dockerfile, re.MULTILINE)
    assert "--reload-on-hup" in dockerfile.split("CMD [")[-1]


def test_compose_waits_for_the_drain() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= DRAIN_S + CLOSE_GRACE_S
    assert "--reload-on-hup" in compose["services"]["gateway"]["command"]


def test_kubernetes_config_and_grace_agree() -> None:
    base = ROOT / "deploy" / "kubernetes" / "base"
    cfg = parse_config(yaml.safe_load((base / "kvroute.yaml").read_text()), environ={})
    assert cfg.shutdown.drain_s == DRAIN_S
    dep = yaml.safe_load((base / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    pre_stop = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + DRAIN_S + CLOSE_GRACE_S
