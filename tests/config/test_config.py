"""Config model: defaults, validation errors that name key and value, env overrides, CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"backends": [{"name": "a", "url": "http://127.0.0.1:9001"}]}


def test_shipped_configs_are_valid() -> None:
    for path in [
        ROOT / "config" / "kvroute.yaml",
        *sorted((ROOT / "config" / "examples").glob("*.yaml")),
    ]:
        cfg = load_config(path, environ={})
        assert cfg.backends or cfg.discovery.type != "static", path


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(MINIMAL, environ={})
    assert cfg.store.redis_url is None  # embedded store
    assert cfg.routing.policy == "kvroute"
    assert cfg.backends[0].pool == "general" and cfg.pool_role("general") == "general"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"backends": [{"name": "a", "url": "not a url"}]}, "backends[0] (name: a).url"),
        (
            {"backends": [{"name": "a", "url": "http://x:1", "pool": "nope"}]},
            "backends[0] (name: a).pool: 'nope' is not a defined pool",
        ),
        (
            {"backends": [{"name": "a", "url": "http://x:1", "kind": "triton"}]},
            "backends[0] (name: a).kind",
        ),
        (
            {"backends": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://x:2"}]},
            "duplicate backend name 'a'",
        ),
        ({**MINIMAL, "routing": {"policy": "random"}}, "routing.policy"),
        ({**MINIMAL, "routing": {"long_threshold_tokens": -5}}, "routing.long_threshold_tokens"),
        (
            {**MINIMAL, "routing": {"long_treshold_tokens": 5}},
            "routing.long_treshold_tokens: unknown key (did you mean `long_threshold_tokens`?)",
        ),
        (
            {**MINIMAL, "collector": {"scrape_interval_s": 10, "stale_after_s": 1}},
            "stale_after_s (1.0) must be >= scrape_interval_s",
        ),
        ({"backends": []}, "backends"),
        ([1, 2], "top level must be a mapping"),
    ],
)
def test_errors_name_the_key_and_value(data: object, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "test.yaml", environ={})
    assert needle in str(exc.value)
    assert str(exc.value).startswith("test.yaml")


def test_error_shows_the_offending_value() -> None:
    with pytest.raises(ConfigError, match=r"routing.safety_margin: .*\(got 1.5\)"):
        parse_config({**MINIMAL, "routing": {"safety_margin": 1.5}}, environ={})


def test_env_overrides_file() -> None:
    cfg = parse_config(
        {**MINIMAL, "store": {"redis_url": "redis://file:6379/0"}},
        environ={
            "KVROUTE_REDIS_URL": "redis://env:6379/1",
            "KVROUTE_PORT": "9999",
            "KVROUTE_ADMIN_KEY": "s3cret",
        },
    )
    assert cfg.store.redis_url == "redis://env:6379/1"
    assert cfg.listen.port == 9999
    assert cfg.admin.api_key == "s3cret"
    # An empty variable clears the value: back to the embedded store.
    assert parse_config(MINIMAL, environ={"KVROUTE_REDIS_URL": ""}).store.redis_url is None


def test_bad_env_value_is_reported_under_its_key() -> None:
    with pytest.raises(ConfigError, match=r"listen\.port"):
        parse_config(MINIMAL, environ={"KVROUTE_PORT": "eighty"})


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_check_config_cli(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(ROOT / "config" / "kvroute.yaml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "OK: 4 backends" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - {name: a, url: 'http://x:1', pool: ghost}\n")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert "backends[0] (name: a).pool: 'ghost' is not a defined pool" in res.stderr


def test_check_config_accepts_server_kinds_with_models(tmp_path: Path) -> None:
    good = tmp_path / "kinds.yaml"
    good.write_text(
        "backends:\n"
        "  - {name: v, url: 'http://x:1', kind: vllm, models: [llama-8b, llama-8b-sql]}\n"
        "  - {name: s, url: 'http://x:2', kind: sglang}\n"
        "  - {name: t, url: 'http://x:3', kind: tgi, models: [mistral-7b]}\n"
        "  - {name: c, url: 'http://x:4', kind: contiguous}\n"
    )
    ok = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(good)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "OK: 4 backends" in ok.stdout, ok.stderr
    cfg = load_config(good)
    assert [b.kind for b in cfg.backends] == ["vllm", "sglang", "tgi", "contiguous"]
    assert cfg.backends[0].models == ("llama-8b", "llama-8b-sql")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - {name: a, url: 'http://x:1', kind: vllm, models: ['']}\n")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and "backends[0] (name: a).models[0]" in res.stderr


def test_bytes_per_token_is_no_longer_accepted() -> None:
    # No backend kind reports KV memory in bytes (vLLM, SGLang and kvroute's gauges count
    # blocks or tokens), so the key did nothing; a config that still sets it is told so.
    with pytest.raises(ConfigError, match="bytes_per_token"):
        parse_config(
            {"backends": [{"name": "a", "url": "http://a:8000", "bytes_per_token": 2}]},
            "test",
            environ={},
        )
