"""`kvroute check-config` as a new user meets it: every problem in one pass, worded for people.

The broken file below has a typo'd key, an unknown pool, a bad enum value, a name that would
read as an option, and secrets; one run must name all of them, by the item's name, with a
suggestion, in no pydantic jargon, and without echoing a secret.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import ConfigError, parse_config
from proxy.config_errors import redact_url

BROKEN = """\
pools:
  general: {role: general}
  long: {role: long}
backends:
  - {name: long-0, url: "http://127.0.0.1:8101", pool: long, kind: contiguous}
  - {name: general-0, url: "http://127.0.0.1:8103", pool: general, kind: contigous}
  - {name: general-1, url: "http://127.0.0.1:8104", pool: lnog}
  - {name: "-rf", url: "http://127.0.0.1:8105"}
routing:
  long_treshold_tokens: 8000
store:
  redis_url: 12345
admin:
  api_key: 987654321
"""


@pytest.fixture
def broken_output(tmp_path: Path) -> str:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    # Drop the file path (pytest's tmp dir is named after the test).
    return res.stderr.replace(str(path), "broken.yaml")


def test_every_problem_in_one_pass(broken_output: str) -> None:
    # Field errors and the cross check (unknown pool) come out of the same run.
    assert "6 problem(s)" in broken_output
    assert (
        "routing.long_treshold_tokens: unknown key (did you mean `long_threshold_tokens`?)"
        in broken_output
    )
    assert "backends[2] (name: general-1).pool: 'lnog' is not a defined pool" in broken_output
    assert "(did you mean `long`?)" in broken_output
    assert "backends[1] (name: general-0).kind: must be one of" in broken_output
    assert "(did you mean `contiguous`?)" in broken_output
    assert (
        "backends[3] (name: -rf).name: " in broken_output
        and "must not start with -" in broken_output
    )
    assert "list positions count from 0" in broken_output


def test_no_library_jargon_and_no_secrets(broken_output: str) -> None:
    for jargon in ("Extra inputs are not permitted", "Input should be", "Value error", "pydantic"):
        assert jargon not in broken_output
    assert "12345" not in broken_output and "987654321" not in broken_output
    assert (
        "store.redis_url: must be a text string (quote it in YAML) (value hidden)" in broken_output
    )


def test_duplicate_name_and_unknown_pool_reported_together() -> None:
    data = {
        "backends": [
            {"name": "a", "url": "http://x:1", "pool": "ghost"},
            {"name": "a", "url": "http://x:2", "bogus": 1},
        ]
    }
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "t.yaml", environ={})
    text = str(exc.value)
    assert "backends[0] (name: a).pool: 'ghost' is not a defined pool" in text
    assert "backends[1] (name: a).name: duplicate backend name 'a'" in text
    assert "backends[1] (name: a).bogus: unknown key" in text


def test_check_config_redacts_the_redis_password(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        "backends: [{name: a, url: 'http://127.0.0.1:9'}]\n"
        "store: {redis_url: 'redis://user:hunter2@redis.internal:6379/0'}\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert res.returncode == 0, res.stderr
    assert "hunter2" not in res.stdout
    assert "redis://user:***@redis.internal:6379/0" in res.stdout


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379", "redis://:***@h:6379"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("http://svc:p4ss@10.0.0.1:80/x", "http://svc:***@10.0.0.1:80/x"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("name", ["-a", "--config=/etc/passwd", "a b", "a/b", ""])
def test_backend_names_are_validated(name: str) -> None:
    with pytest.raises(ConfigError, match=r"backends\[0\]"):
        parse_config({"backends": [{"name": name, "url": "http://x:1"}]}, environ={})


def test_valid_names_still_pass() -> None:
    cfg = parse_config({"backends": [{"name": "gpu-07.a:b_c", "url": "http://x:1"}]}, environ={})
    assert cfg.backends[0].name == "gpu-07.a:b_c"
