"""InferencePool discovery against a small Kubernetes API server (tests/support/kube_api.py):
the pool's selector and target ports, its ready pods, and the list following both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.backends.discovery_inferencepool import (
    InferencePoolDiscovery,
    pod_ready,
    pool_backends,
    pool_selector,
)
from proxy.config import DiscoveryConfig
from tests.support.kube_api import TOKEN, FakeKubeApi, pod

POOLS = {"general", "long"}
VLLM = {"app": "vllm"}


def inference_pool(labels: dict[str, str], ports: list[int]) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns"},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}},
        },
    }


def serving(name: str, ip: str, labels: dict[str, str], ready: bool = True) -> dict[str, Any]:
    obj = pod(name, labels, ready=ready)
    obj["status"]["podIP"] = ip
    return obj


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


def pool_cfg(api: FakeKubeApi, token: Path) -> DiscoveryConfig:
    return DiscoveryConfig(
        type="inferencepool",
        inference_pool="pool",
        api_url=api.url,
        token_path=str(token),
        ca_path=None,
        namespace="ns",
        interval_s=0.05,
    )


def test_the_pool_names_selector_and_ports() -> None:
    assert pool_selector(inference_pool({"b": "2", "a": "1"}, [8000])) == ("a=1,b=2", [8000])
    with pytest.raises(ValueError, match="no selector"):
        pool_selector(inference_pool({}, [8000]))


def test_only_running_ready_pods_with_an_ip() -> None:
    assert pod_ready(serving("p", "10.0.0.1", VLLM)) == "10.0.0.1"
    assert pod_ready(serving("p", "10.0.0.1", VLLM, ready=False)) is None
    leaving = serving("p", "10.0.0.1", VLLM)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_ready(leaving) is None
    assert pod_ready(serving("p", "", VLLM)) is None


def test_each_target_port_of_each_pod_is_an_endpoint() -> None:
    cfg = DiscoveryConfig(type="inferencepool", inference_pool="pool")
    long_pod = serving("b", "10.0.0.2", {**VLLM, "kvroute.io/pool": "long"})
    found = pool_backends(cfg, [8000, 8001], [serving("a", "10.0.0.1", VLLM), long_pod], POOLS)
    assert [(b.name, b.plain_url, b.pool) for b in found] == [
        ("a:8000", "http://10.0.0.1:8000", "general"),
        ("a:8001", "http://10.0.0.1:8001", "general"),
        ("b:8000", "http://10.0.0.2:8000", "long"),
        ("b:8001", "http://10.0.0.2:8001", "long"),
    ]


def test_a_pool_without_a_name_is_refused() -> None:
    with pytest.raises(ValidationError, match="inference_pool is required"):
        DiscoveryConfig(type="inferencepool")


async def _until(changed: asyncio.Event, pred: Any) -> None:
    """Wait (bounded) for a published list that satisfies ``pred``."""
    async with asyncio.timeout(10):
        while not pred():
            changed.clear()
            await changed.wait()


async def test_discovery_follows_the_pool_and_its_pods(kube: FakeKubeApi, token_file: Path) -> None:
    kube.put_inference_pool(inference_pool(VLLM, [8000]))
    kube.add_pod(serving("vllm-0", "10.0.0.1", VLLM))
    kube.add_pod(serving("other", "10.0.0.9", {"app": "other"}))
    disc = InferencePoolDiscovery(pool_cfg(kube, token_file), [], POOLS)
    changed = asyncio.Event()
    disc.on_change.append(lambda _: changed.set())
    await disc.start()
    try:
        assert [(b.name, b.plain_url) for b in disc.backends] == [
            ("vllm-0", "http://10.0.0.1:8000")
        ]
        kube.add_pod(serving("vllm-1", "10.0.0.2", VLLM))
        await _until(changed, lambda: len(disc.backends) == 2)
        # The pool's selector changes: the list follows the pool, not the old selector.
        kube.put_inference_pool(inference_pool({"app": "other"}, [9000]))
        await _until(
            changed, lambda: [b.plain_url for b in disc.backends] == ["http://10.0.0.9:9000"]
        )
    finally:
        await disc.stop()
