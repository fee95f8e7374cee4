"""A backend whose reported allocator differs from its configured kind is flagged (log + /fleet)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from proxy.api.kind_check import kind_mismatch
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until


def test_kind_mismatch_rules() -> None:
    cfg = gateway_cfg(
        [
            {"name": "c", "url": "http://127.0.0.1:1", "kind": "contiguous"},
            {"name": "v", "url": "http://127.0.0.1:2", "kind": "vllm"},
        ]
    )
    assert kind_mismatch(cfg, "c", "contiguous") is None
    assert kind_mismatch(cfg, "v", "paged") is None
    assert kind_mismatch(cfg, "c", None) is None
    assert kind_mismatch(cfg, "gone", "paged") is None
    warning = kind_mismatch(cfg, "c", "paged")
    assert warning is not None and "configured kind 'contiguous'" in warning
    assert "reports a paged allocator" in warning


def test_mismatch_is_logged_once_and_shown_on_fleet(
    engine_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    paged = engine_factory(name="p", allocator="paged")
    right = engine_factory(name="c")
    cfg = gateway_cfg(
        [
            {"name": "p", "url": paged.url, "kind": "contiguous"},
            {"name": "c", "url": right.url, "kind": "contiguous"},
        ]
    )
    caplog.set_level(logging.WARNING, logger="kvroute.config")
    with run_gateway(cfg) as url:

        def flagged() -> bool:
            backends = {b["name"]: b for b in fleet_state(url)["backends"]}
            return bool(backends["p"].get("warnings")) and backends["c"]["report"] is not None

        wait_until(flagged, what="mismatch on /fleet")
        backends = {b["name"]: b for b in fleet_state(url)["backends"]}
        assert "reports a paged allocator" in backends["p"]["warnings"][0]
        assert "warnings" not in backends["c"]
        wait_until(lambda: len(caplog.records) >= 1, what="warning logged")
        # Several scrapes later, still one line.
        wait_until(lambda: fleet_state(url)["backends"][0]["report"]["age_s"] < 0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.config"]
    assert len(lines) == 1 and lines[0].startswith("backend p: configured kind 'contiguous'")
