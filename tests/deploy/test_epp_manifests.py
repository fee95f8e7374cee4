"""The endpoint picker's manifests (deploy/kubernetes/epp), checked offline.

Core objects validate strictly against the Kubernetes OpenAPI schemas (``kubernetes-validate``).
The InferencePool (``inference.networking.k8s.io/v1``) and the HTTPRoute
(``gateway.networking.k8s.io/v1``) are checked against schemas written here from those
APIs' v1 types (the fields these manifests use, unknown fields refused): no CRD of either is
vendored. Then the wiring: the pool's picker is this Service's ext_proc port, the probes
use the gRPC health service, the config loads and discovers the pool's pods.
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from proxy.config import parse_config
from tests.deploy.test_kubernetes import K8S, KUBERNETES_VERSION, find, kubectl

NAMESPACE = "inference"
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {
    "type": "object",
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
    "required": ["number"],
    "additionalProperties": False,
}
META = {"type": "object"}
# inference.networking.k8s.io/v1 InferencePool: selector (matchLabels only), targetPorts
# (1-8), appProtocol, endpointPickerRef (group, kind, name, port, failureMode).
INFERENCE_POOL = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": META,
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string", "maxLength": 63},
                        }
                    },
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": NAME,
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
BACKEND_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": NAME,
        "namespace": {"type": "string"},
        "port": {"type": "integer"},
        "weight": {"type": "integer", "minimum": 0},
    },
}
# gateway.networking.k8s.io/v1 HTTPRoute: the parts used here.
HTTP_ROUTE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": BACKEND_REF},
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {"type": "array", "items": BACKEND_REF},
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "request": {"type": "string", "pattern": "^[0-9]+(h|m|s|ms)$"},
                                    "backendRequest": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
SCHEMAS = {"InferencePool": INFERENCE_POOL, "HTTPRoute": HTTP_ROUTE}


@functools.cache
def _rendered() -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "epp")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def rendered() -> list[dict[str, Any]]:
    return list(_rendered())


def test_epp_manifests_render_and_validate() -> None:
    import kubernetes_validate

    docs = rendered()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "InferencePool", "HTTPRoute"}
    for doc in docs:
        if doc["kind"] in SCHEMAS:
            jsonschema.Draft7Validator(SCHEMAS[doc["kind"]]).validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_the_schemas_refuse_mistakes() -> None:
    pool = yaml.safe_load(yaml.safe_dump(find(rendered(), "InferencePool")))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)
    pool = yaml.safe_load(yaml.safe_dump(find(rendered(), "InferencePool")))
    pool["spec"]["extensionRef"] = {"name": "kvroute-epp"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)


def test_the_pool_picks_with_kvroute_epp() -> None:
    docs = rendered()
    pool = find(docs, "InferencePool")["spec"]
    ref = pool["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    svc = find(docs, "Service", ref["name"])
    (ext_proc,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert ext_proc["appProtocol"] == "kubernetes.io/h2c"
    dep = find(docs, "Deployment", "kvroute-epp")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[ext_proc["targetPort"]] == 9002 and c["args"][0] == "epp"
    assert c["args"][c["args"].index("--grpc-port") + 1] == "9002"
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    route = find(docs, "HTTPRoute")["spec"]
    (backend,) = route["rules"][0]["backendRefs"]
    assert backend["kind"] == "InferencePool" and backend["name"] == "kvroute-pool"


def test_the_config_discovers_the_pools_pods() -> None:
    cfg = parse_config(yaml.safe_load((K8S / "epp" / "kvroute.yaml").read_text()), environ={})
    docs = rendered()
    # The backends are the pods of the pool this kustomization declares.
    assert cfg.discovery.type == "inferencepool" and cfg.discovery.namespace == NAMESPACE
    assert cfg.discovery.inference_pool == find(docs, "InferencePool")["metadata"]["name"]
    # Several replicas need one store for their reservations (active-active).
    assert cfg.store.redis_url
    role = find(docs, "Role", "kvroute-epp")
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
