"""The ``kubernetes`` restart hook against the test Kubernetes API (tests/support/kube_api.py):
it deletes only a pod matching its selector, only the pod it inspected (uid precondition),
and returns once a replacement is Running and Ready, naming it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.config import KubernetesApiConfig, parse_config
from proxy.ops.restart_hooks import make_hook
from proxy.ops.restart_kubernetes import KubernetesHook
from tests.support.kube_api import TOKEN, FakeKubeApi, pod

VLLM = {"app.kubernetes.io/name": "vllm"}


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


@pytest.fixture
def api_cfg(kube: FakeKubeApi, tmp_path: Path) -> KubernetesApiConfig:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    return KubernetesApiConfig(
        api_url=kube.url, token_path=str(token), ca_path=None, namespace="ns"
    )


def replica_set(kube: FakeKubeApi, delay_s: float, ready: bool = True) -> None:
    """Play the ReplicaSet: a deleted pod is replaced after ``delay_s`` by a new pod."""

    def on_delete(name: str) -> None:
        def create() -> None:
            kube.add_pod(pod(f"{name}-new", VLLM, ready=ready))

        threading.Timer(delay_s, create).start()

    kube.on_delete = on_delete


async def test_deletes_the_pod_and_waits_for_a_ready_replacement(
    kube: FakeKubeApi, api_cfg: KubernetesApiConfig
) -> None:
    kube.add_pod(pod("vllm-0", VLLM))
    kube.add_pod(pod("vllm-1", VLLM))
    replica_set(kube, delay_s=0.3)
    hook = KubernetesHook(api_cfg, "app.kubernetes.io/name=vllm", timeout_s=10, poll_s=0.05)
    try:
        result = await hook.restart("vllm-0", "http://10.0.0.1:8000")
    finally:
        await hook.close()
    assert result.ok, result.detail
    assert result.replaced_by == "vllm-0-new"
    assert kube.deleted == ["vllm-0"]
    # It waited for the replacement: the call lasted at least the ReplicaSet's delay.
    assert result.duration_s >= 0.3
    assert "vllm-1" in kube.pods  # the other pod is untouched


async def test_refuses_a_pod_outside_the_selector(
    kube: FakeKubeApi, api_cfg: KubernetesApiConfig
) -> None:
    kube.add_pod(pod("redis-0", {"app.kubernetes.io/name": "redis"}))
    hook = KubernetesHook(api_cfg, "app.kubernetes.io/name=vllm", timeout_s=5, poll_s=0.05)
    try:
        result = await hook.restart("redis-0", "http://10.0.0.9:6379")
    finally:
        await hook.close()
    assert not result.ok and "does not match pod_selector" in result.detail
    assert kube.deleted == [] and "redis-0" in kube.pods


async def test_missing_pod_and_no_replacement_fail_with_reasons(
    kube: FakeKubeApi, api_cfg: KubernetesApiConfig
) -> None:
    hook = KubernetesHook(api_cfg, "app.kubernetes.io/name=vllm", timeout_s=0.5, poll_s=0.05)
    try:
        missing = await hook.restart("vllm-9", "http://x:1")
        assert not missing.ok and "404" in missing.detail
        kube.add_pod(pod("vllm-0", VLLM))
        replica_set(kube, delay_s=0.05, ready=False)  # the replacement never becomes Ready
        stuck = await hook.restart("vllm-0", "http://x:1")
        assert not stuck.ok and "no ready replacement" in stuck.detail
    finally:
        await hook.close()


async def test_uid_precondition_protects_a_namesake(
    kube: FakeKubeApi, api_cfg: KubernetesApiConfig
) -> None:
    """Between the read and the delete a StatefulSet recreated the pod: it is not deleted."""
    kube.add_pod(pod("vllm-0", VLLM, uid="old"))
    api = KubernetesHook(api_cfg, "app.kubernetes.io/name=vllm", timeout_s=2).api
    try:
        kube.add_pod(pod("vllm-0", VLLM, uid="new"))
        with pytest.raises(Exception, match="409"):
            await api.delete_pod("vllm-0", "old")
        assert kube.pods["vllm-0"]["metadata"]["uid"] == "new"
    finally:
        await api.close()


def test_config_builds_the_hook_and_checks_the_selector() -> None:
    cfg = parse_config(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "maintenance": {"hook": {"type": "kubernetes", "pod_selector": "app=vllm"}},
        },
        environ={},
    )
    assert isinstance(make_hook(cfg.maintenance.hook), KubernetesHook)
    for bad in ({"type": "kubernetes"}, {"type": "kubernetes", "pod_selector": "app in (a,b)"}):
        with pytest.raises(Exception, match="pod_selector"):
            parse_config(
                {
                    "backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
                    "maintenance": {"hook": bad},
                },
                environ={},
            )


def test_gateway_restarts_a_pod_and_waits_for_its_replacement(
    kube: FakeKubeApi, api_cfg: KubernetesApiConfig, tmp_path: Path
) -> None:
    """Maintenance end to end: drain pod-1, delete it through the API, the "ReplicaSet" starts
    pod-2 (a fresh engine) which discovery adds; the restart completes on pod-2's fresh report."""
    import httpx

    from tests.support.engines import start_engine, wait_until
    from tests.support.gateway import run_gateway
    from tests.support.kube_api import endpoint_slice

    fleet = {"kvroute.io/fleet": "inference"}
    old = start_engine(name="old", capacity_tokens=50_000)
    fresh = start_engine(name="fresh", capacity_tokens=50_000)
    try:
        kube.add_pod(pod("pod-1", VLLM))
        kube.put_slice(
            endpoint_slice("s", [("pod-1", "127.0.0.1", True)], port=old.port, labels=fleet)
        )

        def replica_set_starts_pod_2(name: str) -> None:
            kube.add_pod(pod("pod-2", VLLM))
            kube.put_slice(
                endpoint_slice("s", [("pod-2", "127.0.0.1", True)], port=fresh.port, labels=fleet)
            )

        kube.on_delete = replica_set_starts_pod_2
        access = api_cfg.model_dump()
        cfg = parse_config(
            {
                "discovery": {
                    "type": "kubernetes",
                    "label_selector": "kvroute.io/fleet=inference",
                    **access,
                },
                "collector": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
                "admin": {"api_key": "k"},
                "maintenance": {
                    "healthy_timeout_s": 15,
                    "drain_settle_s": 0,
                    "hook": {
                        "type": "kubernetes",
                        "pod_selector": "app.kubernetes.io/name=vllm",
                        "kubernetes": access,
                    },
                },
            },
            environ={},
        )
        with run_gateway(cfg) as url, httpx.Client(base_url=url, timeout=10) as c:
            wait_until(
                lambda: any(b["report"] for b in c.get("/fleet").json()["backends"]),
                what="pod-1 reports",
            )
            r = c.post(
                "/admin/backends/pod-1/restart?force=true", headers={"Authorization": "Bearer k"}
            )
            assert r.status_code == 202, r.text

            def done() -> list[dict[str, object]]:
                evs = c.get("/fleet/events", params={"limit": "100"}).json()["events"]
                return [e for e in evs if e["type"] in ("restart_done", "restart_failed")]

            wait_until(lambda: bool(done()), 20, "the restart to finish")
            (result,) = done()
            assert result["type"] == "restart_done", result
            assert kube.deleted == ["pod-1"]
            backends = {b["name"] for b in c.get("/fleet").json()["backends"]}
            assert backends == {"pod-2"}
    finally:
        old.stop()
        fresh.stop()
