"""Checks of the deployment and observability files, without Docker.

- ``Dockerfile`` and ``.dockerignore``: the image builds from exactly the context they allow.
- ``docker-compose.yml``: valid against the vendored Compose Specification schema, and
  consistent with the gateway config, the Prometheus scrape config and the Grafana mounts.
- ``config/alerts.yml``: ``promtool check rules`` and ``promtool test rules`` (when promtool
  is installed; ``KVROUTE_REQUIRE_PROMTOOL=1`` makes its absence a failure).
- The Grafana dashboard: uses only the provisioned datasource and documented metric names.
- ``docs/observability.md``: documents every metric the gateway registers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from proxy.config import load_config
from proxy.core import backend_contract
from proxy.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ALERTS = ROOT / "config" / "alerts.yml"
ALERTS_TEST = ROOT / "config" / "alerts_test.yml"
PROMETHEUS = ROOT / "config" / "prometheus.yml"
DASHBOARD = ROOT / "config" / "grafana" / "dashboards" / "kvroute.json"
DATASOURCES = ROOT / "config" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASH_PROVIDERS = ROOT / "config" / "grafana" / "provisioning" / "dashboards" / "kvroute.yaml"
OBS_DOC = ROOT / "docs" / "observability.md"
SCHEMA = Path(__file__).parents[1] / "data" / "compose-spec.json"

PROMTOOL_APT = "apt-get install -y --no-install-recommends prometheus"

# The gateway's metric names as specified for kvroute (what dashboards and alerts may rely on).
REQUIRED_GATEWAY_METRICS = {
    "largest_contiguous_free_block_ratio",
    "allocation_failure_rate_at_high_free_memory",
    "kvroute_allocation_failures_at_high_free_memory_total",
    "node_uptime_vs_fragmentation_correlation",
    "kvroute_fragmentation_trend_per_hour",
    "kvroute_fragmentation_ratio",
    "kvroute_backend_uptime_seconds",
    "kvroute_backend_free_fraction",
    "kvroute_backend_free_tokens",
    "kvroute_backend_largest_free_block_tokens",
    "kvroute_backend_capacity_tokens",
    "kvroute_backend_up",
    "kvroute_backend_draining",
    "kvroute_reserved_tokens",
    "kvroute_inflight_requests",
    "kvroute_requests_total",
    "kvroute_allocation_failures_total",
    "kvroute_restarts_total",
    "kvroute_scaling_advice",
    "kvroute_effective_demand_tokens",
    "kvroute_queue_depth",
    "kvroute_routing_decision_seconds",
    "kvroute_request_duration_seconds",
    "kvroute_store_degraded",
}
ENGINE_METRICS = {
    v
    for k, v in vars(backend_contract).items()
    if k.isupper() and isinstance(v, str) and v.startswith("kvroute_engine_")
}


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------
# Documented metrics (docs/observability.md is the reference the other checks use)


def documented_metrics() -> dict[str, str]:
    """metric name -> type, from the tables under '## Metric reference'."""
    text = OBS_DOC.read_text(encoding="utf-8")
    section = text.split("## Metric reference", 1)[1]
    found: dict[str, str] = {}
    for m in re.finditer(r"^\| `([A-Za-z_:][A-Za-z0-9_:]*)` \| (\w+) \|", section, re.MULTILINE):
        found[m.group(1)] = m.group(2)
    return found


def allowed_series_names() -> set[str]:
    """Documented names plus the _bucket/_sum/_count series of documented histograms."""
    docs = documented_metrics()
    names = set(docs)
    for name, kind in docs.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_docs_cover_the_specified_gateway_and_engine_metrics() -> None:
    docs = documented_metrics()
    assert REQUIRED_GATEWAY_METRICS - set(docs) == set()
    assert len(ENGINE_METRICS) >= 8
    assert ENGINE_METRICS - set(docs) == set()
    assert docs["largest_contiguous_free_block_ratio"] == "gauge"
    assert docs["kvroute_routing_decision_seconds"] == "histogram"
    assert docs["kvroute_requests_total"] == "counter"


def test_docs_cover_every_metric_the_gateway_registers() -> None:
    """Drift check: a metric added to proxy/gateway/metrics.py must be documented (and so usable here)."""
    gm = GatewayMetrics()
    gm.attach_fleet(lambda: None, lambda: 0.0)
    registered: set[str] = set()
    for family in gm.registry.collect():
        kind = family.type
        registered.add(f"{family.name}_total" if kind == "counter" else family.name)
    assert "kvroute_routing_decision_seconds" in registered
    assert registered - set(documented_metrics()) == set()


# --------------------------------------------------------------------------------------
# PromQL metric-name extraction

_PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels, keywords or numbers)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges, subqueries ($__rate_interval lives here)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names: set[str] = set()
    for m in re.finditer(r"\d[\w.]*|[A-Za-z_:][A-Za-z0-9_:]*", s):
        tok = m.group()
        if tok[0].isdigit() or tok.lower() in _PROMQL_KEYWORDS:
            continue
        if s[m.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        names.add(tok)
    return names


def test_promql_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, class) (rate(kvroute_request_duration_seconds_bucket{class=~"$c"}[$__rate_interval])))'
        " / on (backend) group_left max by (backend) (kvroute_backend_up) > 1e-9"
        " and sum(x_total offset 5m) unless y"
    )
    assert promql_metric_names(expr) == {
        "kvroute_request_duration_seconds_bucket",
        "kvroute_backend_up",
        "x_total",
        "y",
    }


# --------------------------------------------------------------------------------------
# promtool


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("KVROUTE_REQUIRE_PROMTOOL") == "1":
            pytest.fail(
                f"promtool is not on PATH and KVROUTE_REQUIRE_PROMTOOL=1 (install it: {PROMTOOL_APT})"
            )
        pytest.skip(f"promtool not installed ({PROMTOOL_APT})")
    return path


def _run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_rules(promtool: str) -> None:
    r = _run([promtool, "check", "rules", str(ALERTS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 4 rules found" in r.stdout


def test_promtool_unit_tests_for_alerts(promtool: str) -> None:
    r = _run([promtool, "test", "rules", str(ALERTS_TEST)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_fail_when_a_rule_is_broken(promtool: str, tmp_path: Path) -> None:
    """The unit tests really exercise the thresholds: moving one makes them fail."""
    text = ALERTS.read_text(encoding="utf-8").replace(
        "(largest_contiguous_free_block_ratio) < 0.6", "(largest_contiguous_free_block_ratio) < 0.5"
    )
    assert text != ALERTS.read_text(encoding="utf-8")
    (tmp_path / "alerts.yml").write_text(text, encoding="utf-8")
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yml")
    r = _run([promtool, "test", "rules", str(tmp_path / "alerts_test.yml")])
    assert r.returncode != 0
    assert "KVCacheFragmentationHigh" in r.stdout + r.stderr


def test_promtool_check_prometheus_config(promtool: str) -> None:
    r = _run([promtool, "check", "config", str(PROMETHEUS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout


def _dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if "expr" in a]
    return exprs


def test_dashboard_promql_parses(promtool: str, tmp_path: Path) -> None:
    """Every dashboard query is valid PromQL once Grafana's variables are substituted."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    rules = []
    for i, expr in enumerate(_dashboard_exprs(dash)):
        e = (
            expr.replace("$__rate_interval", "1m")
            .replace("$__range", "1h")
            .replace("$__interval", "15s")
        )
        e = e.replace("$backend", ".*")
        assert "$" not in e, f"unhandled Grafana variable in {expr!r}"
        rules.append({"record": f"kvroute:dashboard_query_{i}", "expr": e})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8"
    )
    r = _run([promtool, "check", "rules", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


# --------------------------------------------------------------------------------------
# Alert rules (structure; the behaviour is in config/alerts_test.yml)


def _alert_rules() -> dict[str, dict[str, Any]]:
    doc = _yaml(ALERTS)
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_alerts_cover_the_problem_statement() -> None:
    rules = _alert_rules()
    failure = rules["KVCacheFragmentationAllocationFailure"]
    assert "allocation_failure_rate_at_high_free_memory" in failure["expr"]
    assert failure["labels"]["severity"] == "high"

    high = rules["KVCacheFragmentationHigh"]
    assert re.search(r"largest_contiguous_free_block_ratio\)\s*<\s*0\.6\b", high["expr"])
    assert high["labels"]["severity"] == "medium"
    assert high.get("for") not in (None, "0s", "0m")

    trend = rules["KVCacheFragmentationRisingWithUptime"]
    assert "node_uptime_vs_fragmentation_correlation" in trend["expr"]
    assert "kvroute_fragmentation_trend_per_hour" in trend["expr"]


def test_every_alert_says_restart_not_scale_up() -> None:
    rules = _alert_rules()
    assert len(rules) >= 3
    for name, rule in rules.items():
        ann = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(ann), name
        assert "RESTART" in ann["runbook"], name
        assert re.search(r"do NOT (scale up|add replicas)", ann["runbook"]), name
        assert rule["labels"]["remediation"] == "restart", name
        assert rule["labels"]["severity"] in {"high", "medium", "low"}, name


def test_alert_expressions_use_documented_metrics_only() -> None:
    allowed = allowed_series_names()
    seen: set[str] = set()
    for name, rule in _alert_rules().items():
        used = promql_metric_names(rule["expr"])
        # PromQL inside annotation templates: {{ query `...` }}
        for text in rule["annotations"].values():
            for q in re.findall(r"query\s+`([^`]*)`", text):
                used |= promql_metric_names(q)
        assert used, name
        assert used - allowed == set(), name
        seen |= used
    assert {
        "largest_contiguous_free_block_ratio",
        "allocation_failure_rate_at_high_free_memory",
        "node_uptime_vs_fragmentation_correlation",
        "kvroute_allocation_failures_total",
    } <= seen


# --------------------------------------------------------------------------------------
# Grafana


def _datasource_uid() -> str:
    doc = _yaml(DATASOURCES)
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus"
    return str(ds["uid"])


def _content_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def test_dashboard_loads_and_uses_only_the_provisioned_datasource() -> None:
    uid = _datasource_uid()
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dash["uid"] and dash["title"]
    panels = _content_panels(dash)
    assert len(panels) >= 10
    ids = [p["id"] for p in dash["panels"]] + [
        p["id"] for r in dash["panels"] if r["type"] == "row" for p in r.get("panels", [])
    ]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
            assert t["expr"].strip(), p["title"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == {"type": "prometheus", "uid": uid}
    for ann in dash["annotations"]["list"]:
        assert ann["datasource"] == {"type": "prometheus", "uid": uid}


def test_dashboard_layout_has_no_overlapping_panels() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    boxes = []
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            overlap = a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]
            assert not overlap, (a[0], b[0])


def test_dashboard_queries_use_documented_metrics_only() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    allowed = allowed_series_names()
    used: set[str] = set()
    for expr in _dashboard_exprs(dash):
        names = promql_metric_names(expr)
        assert names, expr
        assert names - allowed == set(), expr
        used |= names
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["query"]["query"])
        assert m, var["query"]
        assert m.group(1) in allowed
    # The panels the fragmentation story needs.
    assert {
        "kvroute_backend_largest_free_block_tokens",
        "kvroute_backend_free_tokens",
        "largest_contiguous_free_block_ratio",
        "kvroute_fragmentation_ratio",
        "kvroute_backend_uptime_seconds",
        "node_uptime_vs_fragmentation_correlation",
        "kvroute_allocation_failures_total",
        "allocation_failure_rate_at_high_free_memory",
        "kvroute_restarts_total",
        "kvroute_scaling_advice",
        "kvroute_requests_total",
    } <= used


def test_dashboard_has_the_required_views() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))

    def panel_using(*metrics: str) -> dict[str, Any]:
        for p in _content_panels(dash):
            exprs = " ".join(t["expr"] for t in p["targets"])
            if all(m in promql_metric_names(exprs) for m in metrics):
                return p
        raise AssertionError(f"no panel shows {metrics} together")

    panel_using("kvroute_backend_largest_free_block_tokens", "kvroute_backend_free_tokens")
    panel_using("kvroute_fragmentation_ratio", "kvroute_backend_uptime_seconds")
    by_cause = panel_using("kvroute_allocation_failures_total")
    assert any("cause" in t["expr"] for t in by_cause["targets"])
    outcomes = panel_using("kvroute_requests_total")
    assert any(re.search(r"by \((?:[\w, ]*\b)?outcome\b", t["expr"]) for t in outcomes["targets"])
    panel_using("kvroute_restarts_total")
    panel_using("kvroute_scaling_advice")


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    compose = _yaml(COMPOSE)
    grafana = compose["services"]["grafana"]
    mounts = _bind_mounts(grafana)
    providers = _yaml(DASH_PROVIDERS)
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    dash_dir = mounts[provider["options"]["path"]]
    assert (dash_dir / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path(mounts, home).resolve() == DASHBOARD.resolve()
    assert mounts["/etc/grafana/provisioning/datasources"].resolve() == DATASOURCES.parent.resolve()
    assert (
        mounts["/etc/grafana/provisioning/dashboards"].resolve() == DASH_PROVIDERS.parent.resolve()
    )
    (ds,) = _yaml(DATASOURCES)["datasources"]
    url = urlparse(ds["url"])
    assert url.hostname == "prometheus" and url.port == 9090
    assert "prometheus" in compose["services"]


# --------------------------------------------------------------------------------------
# docker-compose.yml


def _bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path, for the service's bind mounts (short or long syntax)."""
    out: dict[str, Path] = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            src, dst = parts[0], parts[1]
        else:
            if v.get("type") != "bind":
                continue
            src, dst = v["source"], v["target"]
        if src.startswith(("./", "../", "/")):
            out[dst] = (COMPOSE.parent / src).resolve()
    return out


def _host_path(mounts: dict[str, Path], container_path: str) -> Path:
    for dst, src in mounts.items():
        if container_path == dst:
            return src
        if container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst.rstrip("/")) + 1 :]
    raise AssertionError(f"{container_path} is not inside any bind mount: {sorted(mounts)}")


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR}, with the variable unset."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def _flag(command: list[str], flag: str) -> str:
    i = command.index(flag)
    return command[i + 1]


def _engines(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if s.get("command", [None])[0] == "engine"
    }


def test_compose_validates_against_the_compose_spec_schema() -> None:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    compose = _yaml(COMPOSE)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(compose)
    ]
    assert errors == []


def test_compose_schema_rejects_mistakes() -> None:
    """Control: the schema is strict enough to catch a typo'd key or a bad condition."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    typo = _yaml(COMPOSE)
    typo["services"]["gateway"]["healthchek"] = typo["services"]["gateway"].pop("healthcheck")
    assert list(validator.iter_errors(typo))
    bad_condition = _yaml(COMPOSE)
    bad_condition["services"]["gateway"]["depends_on"]["redis"]["condition"] = "healthy"
    assert list(validator.iter_errors(bad_condition))


def test_compose_services_and_health_ordering() -> None:
    compose = _yaml(COMPOSE)
    services = compose["services"]
    assert {"redis", "gateway", "prometheus", "grafana"} <= set(services)
    assert services["redis"]["image"].split(":") == ["redis", "7"]
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in services, (name, dep)
            assert spec["condition"] == "service_healthy", (name, dep)
    gw_deps = set(services["gateway"]["depends_on"])
    assert gw_deps == {"redis", *_engines(compose)}
    assert "gateway" in services["prometheus"]["depends_on"]
    assert "prometheus" in services["grafana"]["depends_on"]


def test_compose_bind_mounts_and_build_context_exist() -> None:
    compose = _yaml(COMPOSE)
    count = 0
    for name, svc in compose["services"].items():
        for dst, src in _bind_mounts(svc).items():
            assert src.exists(), f"{name}: {src} (mounted at {dst}) does not exist"
            assert str(src).startswith(str(ROOT)), src
            count += 1
        if "build" in svc:
            ctx = COMPOSE.parent / svc["build"]["context"]
            assert (ctx / svc["build"].get("dockerfile", "Dockerfile")).is_file()
            assert svc["image"] == "kvroute:local"
    assert count >= 6


def test_compose_gives_streams_time_to_finish_on_sigterm() -> None:
    """Docker's default 10 s would SIGKILL the gateway mid-stream; it drains for up to 30 s."""
    services = _yaml(COMPOSE)["services"]
    for name in ("gateway", "engine-long-1", "engine-general-1"):
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) > 30, (name, grace)


def test_compose_engines_two_long_two_general() -> None:
    compose = _yaml(COMPOSE)
    engines = _engines(compose)
    assert len(engines) == 4
    for name, svc in engines.items():
        cmd = svc["command"]
        assert _flag(cmd, "--allocator") == "contiguous"
        assert _flag(cmd, "--name") == name
        assert _flag(cmd, "--host") == "0.0.0.0"
        assert int(_flag(cmd, "--capacity-tokens")) == 100_000
        assert "--speedup" in cmd and "--port" in cmd
    cfg = _gateway_config(compose)
    roles = [cfg.pool_role(b.pool) for b in cfg.backends]
    assert sorted(roles) == ["general", "general", "long", "long"]


def _gateway_config(compose: dict[str, Any]) -> Any:
    gw = compose["services"]["gateway"]
    cmd = gw["command"]
    assert cmd[0] == "serve"
    path = _host_path(_bind_mounts(gw), _flag(cmd, "--config"))
    env = {k: _interpolate(str(v)) for k, v in gw["environment"].items()}
    return load_config(path, environ=env)


def test_compose_gateway_config_validates_and_matches_the_engines() -> None:
    compose = _yaml(COMPOSE)
    cfg = _gateway_config(compose)
    gw = compose["services"]["gateway"]
    # Redis from the environment, pointing at the redis service.
    assert cfg.store.redis_url == "redis://redis:6379/0"
    assert urlparse(cfg.store.redis_url).hostname in compose["services"]
    # Listening where the healthcheck, the port mapping and Prometheus look.
    assert cfg.listen.host == "0.0.0.0"
    assert f":{cfg.listen.port}/health" in " ".join(gw["healthcheck"]["test"])
    assert any(str(p).endswith(f":{cfg.listen.port}") for p in gw["ports"])
    # Every backend is an engine service, by name and port.
    engines = _engines(compose)
    assert {b.name for b in cfg.backends} == set(engines)
    for b in cfg.backends:
        url = urlparse(b.base_url)
        assert url.hostname == b.name
        cmd = engines[b.name]["command"]
        assert url.port == int(_flag(cmd, "--port"))
        assert b.kind == _flag(cmd, "--allocator")
        assert f":{url.port}/" in " ".join(engines[b.name]["healthcheck"]["test"])


def test_compose_prometheus_scrapes_gateway_and_engines_and_loads_alerts() -> None:
    compose = _yaml(COMPOSE)
    cfg = _gateway_config(compose)
    prom_svc = compose["services"]["prometheus"]
    mounts = _bind_mounts(prom_svc)
    config_flag = next(a for a in prom_svc["command"] if a.startswith("--config.file="))
    container_cfg = config_flag.split("=", 1)[1]
    assert _host_path(mounts, container_cfg).resolve() == PROMETHEUS.resolve()
    prom = _yaml(PROMETHEUS)
    # rule_files resolve relative to the config file's directory inside the container.
    rule_files = [
        _host_path(mounts, os.path.join(os.path.dirname(container_cfg), f)).resolve()
        for f in prom["rule_files"]
    ]
    assert rule_files == [ALERTS.resolve()]

    engines = _engines(compose)
    pools = {b.name: b.pool for b in cfg.backends}
    scraped: dict[str, dict[str, str]] = {}
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in compose["services"], target
                scraped[host] = {"port": port, **sc.get("labels", {})}
    assert scraped["gateway"]["port"] == str(cfg.listen.port)
    assert set(engines) <= set(scraped)
    for name, svc in engines.items():
        assert scraped[name]["port"] == _flag(svc["command"], "--port")
        assert scraped[name]["backend"] == name
        assert scraped[name]["pool"] == pools[name]


# --------------------------------------------------------------------------------------
# Dockerfile and .dockerignore


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerignore_excludes(rel: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; a directory match covers its contents."""
    excluded = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        negate = pat.startswith("!")
        p = pat[1:] if negate else pat
        p = p.strip().strip("/")
        rx = "".join(
            ".*"
            if tok == "**"
            else "[^/]*"
            if tok == "*"
            else "[^/]"
            if tok == "?"
            else re.escape(tok)
            for tok in re.findall(r"\*\*|\*|\?|[^*?]+", p)
        )
        rx = rx.replace(".*/", "(?:.*/)?")
        if any(re.fullmatch(rx, pre) for pre in prefixes):
            excluded = not negate
    return excluded


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _build_context_files() -> list[str]:
    patterns = _dockerignore_patterns()
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
            if not _dockerignore_excludes(rel, patterns):
                files.append(rel)
    return sorted(files)


def test_dockerignore_matcher() -> None:
    pats = ["*", "!proxy", "**/__pycache__", "!keep.txt"]
    assert _dockerignore_excludes("tests/test_x.py", pats)
    assert not _dockerignore_excludes("proxy/config/__init__.py", pats)
    assert _dockerignore_excludes("proxy/__pycache__/config.cpython-311.pyc", pats)
    assert not _dockerignore_excludes("keep.txt", pats)


def test_dockerfile_shape() -> None:
    instr = _dockerfile()
    froms = [rest for word, rest in instr if word == "FROM"]
    assert froms and all(f.split()[0] == "python:3.11-slim" for f in froms)
    users = [rest for word, rest in instr if word == "USER"]
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in {"root", "0"}
    entry = [rest for word, rest in instr if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["kvroute"]
    assert any(
        word == "RUN" and re.search(r"\bpip install\b.*\s\.(\s|$)", rest) for word, rest in instr
    )


def test_dockerfile_copies_what_pip_install_needs_and_dockerignore_keeps_it() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)
    needed = {"pyproject.toml", "proxy", "loadtest"} | ({readme.group(1)} if readme else set())
    copied: set[str] = set()
    for word, rest in _dockerfile():
        if word == "COPY" and "--from" not in rest:
            srcs = rest.split()[:-1]
            copied |= {s.rstrip("/") for s in srcs if not s.startswith("--")}
    assert needed <= copied
    patterns = _dockerignore_patterns()
    for src in sorted(copied):
        assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which does not exist"
        assert not _dockerignore_excludes(src, patterns), f".dockerignore drops {src}"
    context = _build_context_files()
    assert "proxy/config/__init__.py" in context and "loadtest/__init__.py" in context
    assert not any(
        f.startswith(("tests/", "docs/", ".git/", "config/")) or "__pycache__" in f for f in context
    )


def test_build_context_builds_the_package(tmp_path: Path) -> None:
    """What `pip install .` builds in the image, from exactly the files .dockerignore lets in.

    Runs setuptools' egg_info + build_py (metadata, entry points, package discovery and
    package data) rather than a full wheel build, so it needs neither `wheel` nor a network.
    """
    ctx = tmp_path / "ctx"
    for rel in _build_context_files():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ctx / rel)
    assert (ctx / "README.md").is_file(), (
        "README.md is missing: pyproject's readme and the Dockerfile need it"
    )
    egg, lib = tmp_path / "egg", tmp_path / "lib"
    egg.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "egg_info",
            "--egg-base",
            str(egg),
            "build_py",
            "--build-lib",
            str(lib),
        ],
        cwd=ctx,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (info,) = egg.glob("kvroute.egg-info")
    assert "kvroute = proxy.cli:main" in (info / "entry_points.txt").read_text(encoding="utf-8")
    built = {p.relative_to(lib).as_posix() for p in lib.rglob("*") if p.is_file()}
    assert {
        "proxy/cli.py",
        "proxy/config/__init__.py",
        "proxy/py.typed",
        "loadtest/__init__.py",
    } <= built


# --------------------------------------------------------------------------------------
# The compose commands, run for real (on 127.0.0.1 instead of container hostnames)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _wait_for(
    pred: Any, what: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0
) -> Any:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = pred()
        if result:
            return result
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _exposed_families(text: str) -> set[str]:
    """Family names as a Prometheus scrape sees them (counters with _total), minus _created."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                names.add(s.name)
    return names


def _with(cmd: list[str], **flags: str) -> list[str]:
    out = list(cmd)
    for flag, value in flags.items():
        out[out.index(f"--{flag.replace('_', '-')}") + 1] = value
    return out


def test_compose_commands_run_and_export_documented_metrics(
    redis_server: str, tmp_path: Path
) -> None:
    """The engine and gateway commands in docker-compose.yml, run with the real CLI."""
    compose = _yaml(COMPOSE)
    engines = _engines(compose)
    gw = compose["services"]["gateway"]
    allowed = allowed_series_names()
    ports = {name: _free_port() for name in engines}
    gw_port = _free_port()

    # The compose gateway config, with 127.0.0.1 for the container hostnames.
    data = _yaml(_host_path(_bind_mounts(gw), _flag(gw["command"], "--config")))
    data["listen"] = {"host": "127.0.0.1", "port": gw_port}
    # The session's Redis is shared with other tests: keep this gateway's keys apart.
    data.setdefault("store", {})["key_prefix"] = f"kvroute-deploy-{uuid.uuid4().hex[:8]}"
    for b in data["backends"]:
        b["url"] = f"http://127.0.0.1:{ports[b['name']]}"
    cfg_path = tmp_path / "kvroute.yaml"
    cfg_path.write_text(yaml.safe_dump(data), encoding="utf-8")
    gw_env = {**os.environ, **{k: _interpolate(str(v)) for k, v in gw["environment"].items()}}
    gw_env["KVROUTE_REDIS_URL"] = redis_server

    cli = [sys.executable, "-m", "proxy.cli"]
    runs = [
        (name, _with(svc["command"], port=str(ports[name]), host="127.0.0.1"), None)
        for name, svc in engines.items()
    ]
    runs.append(("gateway", _with(gw["command"], config=str(cfg_path)), gw_env))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # All at once: the gateway copes with engines that are not up yet.
        for name, cmd, env in runs:
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen([*cli, *cmd], env=env, stdout=log, stderr=log))
        for name, port in ports.items():

            def metrics_ok(p: int = port) -> str | None:
                status, text = _get(f"http://127.0.0.1:{p}/metrics")
                return text if status == 200 else None

            exported = _exposed_families(
                _wait_for(metrics_ok, f"{name} /metrics (logs in {tmp_path})", procs)
            )
            assert ENGINE_METRICS <= exported, name
            assert exported - allowed == set(), name

        base = f"http://127.0.0.1:{gw_port}"
        _wait_for(
            lambda: _get(base + "/health")[0] == 200, f"gateway /health (logs in {tmp_path})", procs
        )

        def ratio_for_all_backends() -> str | None:
            status, body = _get(base + "/metrics")
            ok = status == 200 and all(f'backend="{n}"' in body for n in engines)
            return body if ok and "largest_contiguous_free_block_ratio{" in body else None

        exported = _exposed_families(_wait_for(ratio_for_all_backends, "gateway gauges", procs))
        assert "largest_contiguous_free_block_ratio" in exported
        assert exported - allowed == set()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
