"""The Kubernetes manifests under deploy/kubernetes/, checked offline (no cluster needed).

- every kustomization renders with ``kubectl kustomize`` (Debian's ``kubectl``; its absence
  is a failure when ``KVROUTE_REQUIRE_KUBECTL=1``, as in CI);
- core objects validate against the Kubernetes OpenAPI schemas (``kubernetes-validate``,
  schemas shipped inside the package), strictly (unknown fields are errors);
- ServiceMonitor, PrometheusRule and ScaledObject validate against their CRDs' published
  ``openAPIV3Schema`` (vendored in tests/data/crds, see the README there);
- the generated PrometheusRule and dashboard ConfigMap equal the generator's output, and
  ``promtool check rules`` accepts the rules;
- what the gateway relies on is wired: probes, grace period, RBAC limited to what it uses,
  the config in the ConfigMap loads, KEDA scales on the fragmentation-free demand metric.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from proxy.api.drain import CLOSE_GRACE_S
from proxy.config import parse_config
from tests.deploy.test_deploy_files import PROMTOOL_APT

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CRDS = Path(__file__).parents[1] / "data" / "crds"
KUBERNETES_VERSION = "1.32.0"
RENDERED = ["base", "overlays/production", "overlays/redis-statefulset", "fleet", "fleet-keda"]
# The gateway's namespace, and the inference fleet's (deploy/kubernetes/fleet).
GATEWAY_NS = "kvroute"
FLEET_NS = "inference"
CRD_FILES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("KVROUTE_REQUIRE_KUBECTL") == "1":
            pytest.fail(
                "kubectl is not on PATH and KVROUTE_REQUIRE_KUBECTL=1 (apt-get install kubectl)"
            )
        pytest.skip("kubectl not installed (apt-get install kubectl)")
    return path


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("KVROUTE_REQUIRE_PROMTOOL") == "1":
            pytest.fail(f"promtool is not on PATH and KVROUTE_REQUIRE_PROMTOOL=1 ({PROMTOOL_APT})")
        pytest.skip(f"promtool not installed ({PROMTOOL_APT})")
    return path


@functools.cache
def _render(target: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(target: str) -> list[dict[str, Any]]:
    return list(_render(target))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} found"
    return hits[0]


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / CRD_FILES[(api_version, kind)]).read_text(encoding="utf-8"))
    version = api_version.split("/")[1]
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return dict(v["schema"]["openAPIV3Schema"])
    raise AssertionError(f"{kind}: no version {version} in the vendored CRD")


def _strict(schema: Any) -> Any:
    """Structural schemas prune unknown fields; for a test, make them errors instead."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def validate_crd_object(doc: dict[str, Any]) -> None:
    schema = _strict(crd_schema(doc["apiVersion"], doc["kind"]))
    # metadata is validated by the API server's ObjectMeta, not by the CRD's schema.
    schema["properties"]["metadata"] = {"type": "object"}
    # No check_schema: the CRDs' patterns are Go regexps (e.g. a "(?i)" flag mid-pattern);
    # only patterns of fields present are compiled.
    jsonschema.Draft7Validator(schema).validate(doc)


# --------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("target", RENDERED)
def test_kustomizations_render_and_validate(target: str) -> None:
    import kubernetes_validate

    docs = render(target)
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_FILES:
            validate_crd_object(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        namespace = FLEET_NS if target.startswith("fleet") else GATEWAY_NS
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == namespace, doc[
            "metadata"
        ]


def test_validation_catches_mistakes() -> None:
    """The two validators are not vacuous: a typo'd field fails each of them."""
    import kubernetes_validate

    dep = find(render("base"), "Deployment", "kvroute")
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    so = find(render("fleet-keda"), "ScaledObject")
    bad = yaml.safe_load(yaml.safe_dump(so))
    bad["spec"]["minReplicas"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate_crd_object(bad)
    sm = find(render("overlays/production"), "ServiceMonitor")
    bad = yaml.safe_load(yaml.safe_dump(sm))
    bad["spec"]["endpoints"][0]["interval"] = "often"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd_object(bad)


# --------------------------------------------------------------------------- the gateway
def test_gateway_deployment_is_production_shaped() -> None:
    docs = render("base")
    dep = find(docs, "Deployment", "kvroute")
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # /ready turns 503 the moment a shutdown begins (proxy.api.drain).
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "livenessProbe" in c and c["livenessProbe"]["httpGet"]["path"] not in (
        "/health",
        "/ready",
    )
    assert "--reload-on-hup" in c["args"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    cfg = parse_config(yaml.safe_load((K8S / "base" / "kvroute.yaml").read_text()), environ={})
    # The pod outlives the preStop pause, the drain and the last events' close; the drain
    # covers a whole stream (upstream.total_timeout_s).
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    needed = pre_stop + cfg.shutdown.drain_s + CLOSE_GRACE_S
    assert pod["terminationGracePeriodSeconds"] >= needed
    assert cfg.shutdown.drain_s >= cfg.upstream.total_timeout_s
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    svc = find(docs, "Service", "kvroute")
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    env = {e["name"]: e for e in c["env"]}
    ref = env["KVROUTE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    # The operator's Secret, referenced by name; kustomize never applies (or resets) it.
    assert ref["name"] == "kvroute-admin" and ref["optional"] is True
    assert not [d for d in docs if d["kind"] == "Secret"]


@pytest.mark.parametrize("target", RENDERED)
def test_no_secret_with_an_empty_key_is_ever_applied(target: str) -> None:
    """An applied Secret with an empty key resets the operator's key on every `apply -k`."""
    for doc in render(target):
        if doc["kind"] != "Secret":
            continue
        values = {**doc.get("data", {}), **doc.get("stringData", {})}
        assert values and all(v not in ("", None) for v in values.values()), doc["metadata"]


def test_configmap_holds_a_valid_kubernetes_config() -> None:
    docs = render("base")
    cm = next(
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvroute-config")
    )
    dep = find(docs, "Deployment", "kvroute")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    # The generated name carries a content hash, so a config change rolls the Deployment.
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    cfg = parse_config(yaml.safe_load(cm["data"]["kvroute.yaml"]), environ={})
    assert cfg.discovery.type == "kubernetes" and cfg.listen.host == "0.0.0.0"
    assert cfg.maintenance.hook.type == "kubernetes" and cfg.maintenance.hook.pod_selector
    assert cfg.store.redis_url is not None and "kvroute-redis" in cfg.store.redis_url


def test_rbac_grants_only_what_the_gateway_uses_in_the_fleets_namespace() -> None:
    docs = render("fleet")
    role = find(docs, "Role", "kvroute-gateway")
    # The gateway looks where the RBAC lets it: discovery and restarts both in the fleet's namespace.
    cfg = parse_config(yaml.safe_load((K8S / "base" / "kvroute.yaml").read_text()), environ={})
    assert role["metadata"]["namespace"] == FLEET_NS
    assert cfg.discovery.namespace == FLEET_NS
    assert cfg.maintenance.hook.kubernetes.namespace == FLEET_NS
    grants = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert grants == {
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "delete"),
    }
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = find(docs, "RoleBinding")
    (subject,) = binding["subjects"]
    gateway = find(render("base"), "Deployment")
    assert subject["name"] == gateway["spec"]["template"]["spec"]["serviceAccountName"]
    assert subject["namespace"] == gateway["metadata"]["namespace"] == GATEWAY_NS
    # Nothing in the gateway's own namespace grants anything.
    assert not [d for d in render("base") if d["kind"] in ("Role", "RoleBinding")]


def test_redis_external_by_default_statefulset_overlay() -> None:
    assert find(render("base"), "Service", "kvroute-redis")["spec"]["type"] == "ExternalName"
    docs = render("overlays/redis-statefulset")
    svc = find(docs, "Service", "kvroute-redis")
    sts = find(docs, "StatefulSet", "kvroute-redis")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]


# --------------------------------------------------------------------------- monitoring, KEDA
def test_generated_monitoring_files_are_current() -> None:
    out = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rule = find(render("overlays/production"), "PrometheusRule")
    alerts = yaml.safe_load((ROOT / "config" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_generated_rules_pass_promtool(tmp_path: Path, promtool: str) -> None:
    rule = find(render("overlays/production"), "PrometheusRule")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_servicemonitor_and_dashboard_match_the_gateway() -> None:
    docs = render("overlays/production")
    sm = find(docs, "ServiceMonitor")
    svc = find(docs, "Service", "kvroute")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    cm = find(docs, "ConfigMap", "kvroute-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = json.loads((ROOT / "config" / "grafana" / "dashboards" / "kvroute.json").read_text())
    assert json.loads(cm["data"]["kvroute.json"]) == source


def test_keda_scales_on_demand_that_ignores_fragmentation() -> None:
    from proxy.ops import metrics as ops_metrics

    so = find(render("fleet-keda"), "ScaledObject")
    # A ScaledObject scales a Deployment of its own namespace: the fleet's.
    assert so["metadata"]["namespace"] == FLEET_NS
    assert not [d for d in render("overlays/production") if d["kind"] == "ScaledObject"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert "kvroute_effective_demand_tokens" in query
    # The metric is the one the ops collector exports, with the fragmentation exclusion.
    source = Path(ops_metrics.__file__).read_text()
    assert '"kvroute_effective_demand_tokens"' in source and "excluding fragmentation" in source
    assert int(trigger["metadata"]["threshold"]) > 0
    assert so["spec"]["scaleTargetRef"]["kind"] == "Deployment"
