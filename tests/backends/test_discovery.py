"""Backend discovery against real servers: a small Kubernetes API (tests/support/kube_api.py,
the documented EndpointSlice list/watch shapes) and a real DNS server (dnslib) on 127.0.0.1.

No live cluster runs here: the fake API serves what the Kubernetes API reference documents
(list with resourceVersion, watch events ADDED/MODIFIED/DELETED, ERROR 410 Expired).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dns.asyncresolver
import httpx
import pytest
from dnslib import RR, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from loadtest.local_fleet import free_port
from proxy.backends.discovery_dns import DnsDiscovery
from proxy.backends.discovery_kubernetes import KubernetesDiscovery, slice_backends
from proxy.config import DiscoveryConfig, parse_config
from tests.support.engines import start_engine, wait_until
from tests.support.gateway import run_gateway
from tests.support.kube_api import TOKEN, FakeKubeApi, endpoint_slice

POOLS = {"general", "long"}
FLEET = {"kvroute.io/fleet": "inference"}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


def kube_cfg(api: FakeKubeApi, token: Path, **kw: Any) -> DiscoveryConfig:
    fields: dict[str, Any] = {
        "type": "kubernetes",
        "api_url": api.url,
        "token_path": str(token),
        "ca_path": None,
        "namespace": "ns",
        "label_selector": "kvroute.io/fleet=inference",
        "port": "http",
        "interval_s": 1.0,
    }
    fields.update(kw)
    return DiscoveryConfig(**fields)


async def until(pred: Any, what: str, limit_s: float = 10.0) -> None:
    """Poll a condition another thread makes true (the API server's thread), with a deadline."""
    async with asyncio.timeout(limit_s):
        while not pred():  # noqa: ASYNC110  (set by another thread's server, no event to await)
            await asyncio.sleep(0.02)


def names(d: Any) -> set[str]:
    return {b.name for b in d.backends}


# --------------------------------------------------------------------------- pure shapes
def test_slice_backends_reads_the_documented_shape() -> None:
    cfg = DiscoveryConfig(type="kubernetes", port="http", kind="vllm")
    obj = endpoint_slice(
        "vllm-abc",
        [("vllm-0", "10.0.0.1", True), ("vllm-1", "10.0.0.2", False), ("vllm-2", "10.0.0.3", None)],
        port=8000,
        labels={"kvroute.io/pool": "long"},
    )
    got = slice_backends(cfg, obj, POOLS)
    # ready=false is left out; an absent condition counts as ready (API reference).
    assert [(b.name, b.base_url, b.pool, b.kind) for b in got] == [
        ("vllm-0", "http://10.0.0.1:8000", "long", "vllm"),
        ("vllm-2", "http://10.0.0.3:8000", "long", "vllm"),
    ]
    # A port name the slice does not have: nothing to route to.
    assert slice_backends(DiscoveryConfig(type="kubernetes", port="grpc"), obj, POOLS) == []
    # A numeric port is used as is; an unknown pool label falls back to the default pool.
    obj["metadata"]["labels"]["kvroute.io/pool"] = "nope"
    got = slice_backends(DiscoveryConfig(type="kubernetes", port=9000), obj, POOLS)
    assert {(b.base_url, b.pool) for b in got} == {
        ("http://10.0.0.1:9000", "general"),
        ("http://10.0.0.3:9000", "general"),
    }
    v6 = endpoint_slice("v6", [("p", "fd00::1", True)], port=8000)
    (b,) = slice_backends(cfg, v6, POOLS)
    assert b.base_url == "http://[fd00::1]:8000"


def test_config_accepts_discovery_without_static_backends() -> None:
    cfg = parse_config(
        {"discovery": {"type": "dns", "name": "vllm.inference.svc", "port": 8000}}, environ={}
    )
    assert cfg.backends == [] and cfg.discovery.type == "dns"
    with pytest.raises(Exception, match="backends"):
        parse_config({}, environ={})
    with pytest.raises(Exception, match=r"discovery\.name"):
        parse_config({"discovery": {"type": "dns"}}, environ={})
    with pytest.raises(Exception, match="pool"):
        parse_config({"discovery": {"type": "kubernetes", "pool": "missing"}}, environ={})


# --------------------------------------------------------------------------- kubernetes
async def test_kubernetes_list_then_watch_follows_the_fleet(
    kube: FakeKubeApi, token_file: Path
) -> None:
    kube.put_slice(
        endpoint_slice("vllm-a", [("vllm-0", "127.0.0.10", True)], port=8000, labels=FLEET)
    )
    kube.put_slice(
        endpoint_slice("other", [("db-0", "127.0.0.99", True)], port=5432, labels={"app": "db"})
    )
    d = KubernetesDiscovery(kube_cfg(kube, token_file), [], POOLS)
    changes: list[set[str]] = []
    d.on_change.append(lambda bs: changes.append({b.name for b in bs}))
    await d.start()
    try:
        # The first list is done before start() returns: the gateway serves with backends.
        assert names(d) == {"vllm-0"}
        # Scale up: a new ready endpoint in the slice (MODIFIED) and a new slice (ADDED).
        kube.put_slice(
            endpoint_slice(
                "vllm-a",
                [("vllm-0", "127.0.0.10", True), ("vllm-1", "127.0.0.11", True)],
                port=8000,
                labels=FLEET,
            )
        )
        kube.put_slice(
            endpoint_slice(
                "vllm-long",
                [("long-0", "127.0.0.20", True)],
                port=8000,
                labels={**FLEET, "kvroute.io/pool": "long"},
            )
        )
        await until(lambda: names(d) == {"vllm-0", "vllm-1", "long-0"}, "scale up")
        assert {b.name: b.pool for b in d.backends}["long-0"] == "long"
        # A pod failing readiness leaves; a deleted slice takes its endpoints along.
        kube.put_slice(
            endpoint_slice(
                "vllm-a",
                [("vllm-0", "127.0.0.10", False), ("vllm-1", "127.0.0.11", True)],
                port=8000,
                labels=FLEET,
            )
        )
        kube.delete_slice("vllm-long")
        await until(lambda: names(d) == {"vllm-1"}, "scale down")
        assert changes[0] == {"vllm-0"} and changes[-1] == {"vllm-1"}
        # Every request carried the service-account token.
        assert all("labelSelector=kvroute.io" in q for _m, q in kube.requests)
    finally:
        await d.stop()


async def test_kubernetes_watch_410_gone_relists(kube: FakeKubeApi, token_file: Path) -> None:
    kube.put_slice(
        endpoint_slice("vllm-a", [("vllm-0", "127.0.0.10", True)], port=8000, labels=FLEET)
    )
    d = KubernetesDiscovery(kube_cfg(kube, token_file), [], POOLS)
    await d.start()
    try:
        await until(lambda: any("watch=1" in q for _m, q in kube.requests), "a watch")
        assert d.relists == 1
        # The change happens while history is compacted: the watch gets ERROR 410 and only a
        # new list can see the change.
        kube.put_slice(
            endpoint_slice("vllm-a", [("vllm-9", "127.0.0.19", True)], port=8000, labels=FLEET)
        )
        kube.compact()
        await until(lambda: names(d) == {"vllm-9"}, "relist after 410")
        assert d.relists >= 2
    finally:
        await d.stop()


async def test_kubernetes_unauthorized_is_retried_not_fatal(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    bad = tmp_path / "token"
    bad.write_text("wrong")
    kube.put_slice(
        endpoint_slice("vllm-a", [("vllm-0", "127.0.0.10", True)], port=8000, labels=FLEET)
    )
    d = KubernetesDiscovery(kube_cfg(kube, bad), [], POOLS)
    await d.start()  # a failed first list does not stop the gateway from starting
    try:
        assert names(d) == set()
        # The token is re-read on every request (kubelet rotates it): a fixed file heals it.
        bad.write_text(TOKEN)
        await until(lambda: names(d) == {"vllm-0"}, "recovery after the token is fixed")
    finally:
        await d.stop()


# --------------------------------------------------------------------------- dns
class Records(BaseResolver):  # type: ignore[misc]
    """A zone the test edits while the server runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rrs: list[RR] = []

    def set(self, zone: str) -> None:
        with self.lock:
            self.rrs = RR.fromZone(zone)

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        q = request.q
        with self.lock:
            hits = [r for r in self.rrs if r.rname == q.qname and r.rtype == q.qtype]
            known = any(r.rname == q.qname for r in self.rrs)
        for r in hits:
            reply.add_answer(r)
        if not known:
            reply.header.rcode = 3  # NXDOMAIN
        return reply


@pytest.fixture
def dns_server() -> Iterator[tuple[Records, dns.asyncresolver.Resolver]]:
    records = Records()
    port = free_port()
    server = DNSServer(
        records, port=port, address="127.0.0.1", tcp=False, logger=DNSLogger(logf=lambda _s: None)
    )
    server.start_thread()
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    try:
        yield records, resolver
    finally:
        server.stop()


async def test_dns_a_records_follow_changes(dns_server: tuple[Records, Any]) -> None:
    records, resolver = dns_server
    records.set(
        "vllm.test. 5 IN A 127.0.0.10\nvllm.test. 5 IN A 127.0.0.11\nvllm.test. 5 IN AAAA ::1"
    )
    cfg = DiscoveryConfig(type="dns", name="vllm.test", port=8000, interval_s=0.05)
    d = DnsDiscovery(cfg, [], resolver=resolver)
    await d.start()
    try:
        assert {b.base_url for b in d.backends} == {
            "http://127.0.0.10:8000",
            "http://127.0.0.11:8000",
            "http://[::1]:8000",
        }
        records.set("vllm.test. 5 IN A 127.0.0.11")
        await until(lambda: names(d) == {"127.0.0.11:8000"}, "a removed record")
        records.set("other.test. 5 IN A 127.0.0.1")  # the name is gone: NXDOMAIN
        await until(lambda: names(d) == set(), "NXDOMAIN empties the list")
    finally:
        await d.stop()


async def test_dns_srv_records_give_host_and_port(dns_server: tuple[Records, Any]) -> None:
    records, resolver = dns_server
    records.set(
        "\n".join(
            [
                "_http._tcp.vllm.test. 5 IN SRV 0 50 8001 vllm-0.vllm.test.",
                "_http._tcp.vllm.test. 5 IN SRV 0 50 8002 vllm-1.vllm.test.",
                "vllm-0.vllm.test. 5 IN A 127.0.0.10",
                "vllm-1.vllm.test. 5 IN A 127.0.0.11",
            ]
        )
    )
    cfg = DiscoveryConfig(type="dns", name="_http._tcp.vllm.test", interval_s=0.05)
    d = DnsDiscovery(cfg, [], resolver=resolver)
    await d.start()
    try:
        assert {(b.name, b.base_url) for b in d.backends} == {
            ("vllm-0:8001", "http://127.0.0.10:8001"),
            ("vllm-1:8002", "http://127.0.0.11:8002"),
        }
    finally:
        await d.stop()


# --------------------------------------------------------------------------- the gateway follows
def test_gateway_follows_discovered_backends(kube: FakeKubeApi, token_file: Path) -> None:
    """Collector, health checks and routing follow EndpointSlice changes in a running gateway."""
    e1 = start_engine(capacity_tokens=50_000)
    e2 = start_engine(capacity_tokens=50_000)
    try:
        kube.put_slice(
            endpoint_slice("vllm-a", [("pod-1", "127.0.0.1", True)], port=e1.port, labels=FLEET)
        )
        cfg = parse_config(
            {
                "discovery": kube_cfg(kube, token_file).model_dump(),
                "collector": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
                "health": {"active": {"interval_s": 0.2}},
                # The engines serve "sim-model"; this test sends "m" (model routing: 404).
                "routing": {"unknown_model": "pass_through"},
            },
            environ={},
        )
        with run_gateway(cfg) as url, httpx.Client(base_url=url, timeout=10) as c:

            def fleet() -> dict[str, Any]:
                return {b["name"]: b for b in c.get("/fleet").json()["backends"]}

            wait_until(
                lambda: (fleet().get("pod-1") or {}).get("report") is not None, what="pod-1 reports"
            )
            kube.put_slice(
                endpoint_slice(
                    "vllm-a",
                    [("pod-1", "127.0.0.1", False), ("pod-2", "127.0.0.1", True)],
                    port=e2.port,
                    labels=FLEET,
                )
            )
            wait_until(lambda: set(fleet()) == {"pod-2"}, what="pod-1 leaves, pod-2 joins")
            wait_until(lambda: fleet()["pod-2"]["report"] is not None, what="pod-2 scraped")
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-backend"] == "pod-2"
    finally:
        e1.stop()
        e2.stop()
