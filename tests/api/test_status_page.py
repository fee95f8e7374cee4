"""The built-in status page at GET /: served as is, and rendered by a real headless Chromium.

Chromium is Debian's ``chromium`` package (``apt-get install -y chromium``). Without it the
browser test skips, unless ``KVROUTE_REQUIRE_CHROMIUM=1`` (CI), where it fails instead.
``KVROUTE_UPDATE_SCREENSHOTS=1`` also writes the screenshot to docs/img/status-page.png.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.local_fleet import free_port
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

ROOT = Path(__file__).resolve().parents[2]
DOC_SHOT = ROOT / "docs" / "img" / "status-page.png"
MAX_PNG_BYTES = 150 * 1024
KEY = "status-page-key"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.access("/usr/bin/chromium", os.X_OK):
        found = "/usr/bin/chromium"
    if found is None:
        if os.environ.get("KVROUTE_REQUIRE_CHROMIUM") == "1":
            pytest.fail(
                "chromium is not installed but KVROUTE_REQUIRE_CHROMIUM=1: apt-get install -y chromium",
                pytrace=False,
            )
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    return found


def browse(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=3000",  # let the page's fetch + render run before the dump
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)


def test_status_page_is_served_as_a_static_file(engine_factory: Callable[..., Any]) -> None:
    e = engine_factory(name="e1")
    with run_gateway(gateway_cfg([{"name": "e1", "url": e.url, "kind": "contiguous"}])) as url:
        r = httpx.get(url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.content == (ROOT / "proxy" / "api" / "static" / "status.html").read_bytes()
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-cache"
    page = r.text
    assert "fetch(path" in page and '"/fleet"' in page and "setTimeout(refresh, 1000)" in page
    assert not re.search(
        r"""(src|href)=["']https?://""", page
    )  # no external resources, no build step
    assert "innerHTML" not in page  # backend names are set as text, never parsed as HTML
    for link in ("/fleet", "/fleet/advice", "/metrics"):
        assert f'<a href="{link}">{link}</a>' in page


def test_fleet_counts_requests_errors_and_failovers_per_node(
    engine_factory: Callable[..., Any],
) -> None:
    bad, good = engine_factory(name="bad"), engine_factory(name="good")
    httpx.post(bad.url + "/admin/fault", json={"mode": "error500"}, timeout=5).raise_for_status()
    cfg = gateway_cfg(
        [
            {"name": "bad", "url": bad.url, "kind": "contiguous"},
            {"name": "good", "url": good.url, "kind": "contiguous"},
        ],
        routing={"policy": "round_robin"},
        health={"active": {"enabled": False}},
    )
    with run_gateway(cfg) as url:
        wait_until(lambda: all(b["report"] for b in fleet_state(url)["backends"]), what="reports")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "good"
        counts = {b["name"]: b["counts"] for b in fleet_state(url)["backends"]}
    # Every request ended on "good"; round robin tried "bad" first at least once (it fails
    # every request with a 500), and each of those attempts moved on: a failover.
    assert counts["good"] == {"requests": 4, "errors": 0, "failovers": 0}
    assert counts["bad"]["requests"] == 0 and counts["bad"]["errors"] == 0
    assert counts["bad"]["failovers"] >= 1


def test_fleet_and_metrics_say_why_a_backend_is_down(engine_factory: Callable[..., Any]) -> None:
    """The collector's verdict per backend, not only the log: a refused port, then a
    backend that starts answering 500 on its metrics; the healthy one's scrapes counted."""
    good, sick = engine_factory(name="good"), engine_factory(name="sick")
    cfg = gateway_cfg(
        [
            {"name": "good", "url": good.url, "kind": "contiguous"},
            {"name": "sick", "url": sick.url, "kind": "contiguous"},
            {"name": "gone", "url": f"http://127.0.0.1:{free_port()}", "kind": "contiguous"},
        ],
        health={"active": {"enabled": False}},
    )
    with run_gateway(cfg) as url:

        def scrape(name: str) -> dict[str, Any]:
            by_name = {b["name"]: b for b in fleet_state(url)["backends"]}
            got: dict[str, Any] = by_name[name]["scrape"]
            return got

        wait_until(lambda: scrape("gone")["outcome"] == "down", what="gone marked down")
        sick.fault("error500", scope="all")  # its /metrics too
        wait_until(lambda: scrape("sick")["outcome"] == "down", what="sick marked down")
        fleet = fleet_state(url)
        metrics = httpx.get(url + "/metrics", timeout=5).text

    assert fleet["collector"]["leader"] is True and fleet["collector"]["rounds_total"] >= 3
    by_name = {b["name"]: b for b in fleet["backends"]}
    ok = by_name["good"]["scrape"]
    assert ok["outcome"] == "ok" and ok["reason"] == "" and ok["consecutive_failures"] == 0
    assert ok["latency_s"] > 0 and ok["last_success_at"] > 0 and by_name["good"]["up"] is True
    gone = by_name["gone"]["scrape"]
    assert gone["reason"].startswith("connect error") and gone["last_success_at"] is None
    assert gone["consecutive_failures"] >= cfg.collector.fall and by_name["gone"]["up"] is False
    sick_scrape = by_name["sick"]["scrape"]
    assert "HTTP 500" in sick_scrape["reason"] and sick_scrape["last_success_at"] > 0
    assert by_name["sick"]["up"] is False

    def value(sample: str) -> float:
        line = next(x for x in metrics.splitlines() if x.startswith(sample + " "))
        return float(line.split()[-1])

    assert value('kvroute_scrapes_total{backend="good",result="ok"}') >= 3
    assert value('kvroute_scrapes_total{backend="gone",result="connect"}') >= cfg.collector.fall
    assert value('kvroute_scrapes_total{backend="sick",result="http_status"}') >= 1
    assert value('kvroute_scrapes_total{backend="sick",result="ok"}') >= 1
    assert value('kvroute_scrape_consecutive_failures{backend="good"}') == 0
    assert value("kvroute_collector_leader") == 1


def test_status_page_in_headless_chromium(
    engine_factory: Callable[..., Any], tmp_path: Path
) -> None:
    binary = chromium()
    long0 = engine_factory(name="long-0")
    g0 = engine_factory(name="general-0")
    g1 = engine_factory(name="general-1")
    g0.fragment(4_000)  # 48% used; free: one 4k block + 48k in 4k gaps
    g1.hold(30_000)
    cfg = gateway_cfg(
        [
            {"name": "long-0", "url": long0.url, "pool": "long", "kind": "contiguous"},
            {"name": "general-0", "url": g0.url, "kind": "contiguous"},
            {"name": "general-1", "url": g1.url, "kind": "contiguous"},
            # Nothing listens there: down, and must not be drawn as free memory.
            {"name": "gone", "url": f"http://127.0.0.1:{free_port()}", "kind": "contiguous"},
        ],
        admin={"api_key": KEY},
    )
    names = ["long-0", "general-0", "general-1"]
    with run_gateway(cfg) as url:
        wait_until(
            lambda: all(b["report"] or not b["up"] for b in fleet_state(url)["backends"]),
            what="reports, and the dead backend marked down",
        )
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(3):
            httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).raise_for_status()
        httpx.post(
            url + "/admin/backends/general-1/drain", headers={"x-admin-key": KEY}, timeout=10
        ).raise_for_status()
        dom = browse(binary, tmp_path / "profile-dom", "--dump-dom", url + "/")
        shot = tmp_path / "status-page.png"
        pic = browse(
            binary,
            tmp_path / "profile-shot",
            "--window-size=1100,520",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            url + "/",
        )

    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-rendered="4"' in html, html[-3000:]
    gone = re.search(r'<tr data-node="gone" class="off">.*?</tr>', html)
    assert gone is not None and '<span class="state down">down</span>' in gone.group(0)
    assert '<div class="bar off" data-backend="gone"><span class="off"' in gone.group(0)
    assert "scrape: connect error" in gone.group(0)  # why, not only that
    assert 'class="used"' not in gone.group(0) and 'class="block"' not in gone.group(0)
    for name in names:
        assert f'<tr data-node="{name}"><td class="name">{name}</td>' in html
        assert re.search(
            rf'<div class="bar" data-backend="{re.escape(name)}"><span class="used"', html
        )
    # general-0: used | largest block | smaller gaps, as the allocator reports them.
    bar = re.search(r'<div class="bar" data-backend="general-0">(.*?)</div>', html)
    assert bar is not None
    widths = re.findall(r'class="(used|block|gaps)" style="width:([\d.]+)%"', bar.group(1))
    assert widths == [("used", "48.00"), ("block", "4.00"), ("gaps", "48.00")]
    row = re.search(r'<tr data-node="general-1">.*?</tr>', html)
    assert row is not None and '<span class="state draining">draining</span>' in row.group(0)
    assert '<td class="ratio low">0.08</td>' in html  # general-0's block ratio, flagged
    # This replica's counts per node: the three requests sent above, no errors.
    answered = re.findall(r'<td class="count requests">(\d+)</td>', html)
    assert len(answered) == 4 and sum(map(int, answered)) == 3, html[-3000:]
    assert '<td class="count errors bad">' not in html
    assert '<a href="/fleet/advice">/fleet/advice</a>' in html
    # Allocator and advice in words, not raw enums.
    assert "contiguous (fragments: needs whole blocks)" in html
    assert "configured kind: contiguous" in html
    action = re.search(r'<span class="action" data-action="(\w+)">(.*?)</span>', html)
    assert action is not None and action.group(2) != action.group(1).upper(), html[-2000:]
    assert action.group(2).endswith(".") and " " in action.group(2)

    assert pic.returncode == 0, pic.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < MAX_PNG_BYTES
    if os.environ.get("KVROUTE_UPDATE_SCREENSHOTS") == "1":
        DOC_SHOT.parent.mkdir(parents=True, exist_ok=True)
        DOC_SHOT.write_bytes(data)


def test_missing_chromium_fails_when_required_and_skips_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setenv("KVROUTE_REQUIRE_CHROMIUM", "1")
    with pytest.raises(pytest.fail.Exception, match="KVROUTE_REQUIRE_CHROMIUM=1"):
        chromium()
    monkeypatch.delenv("KVROUTE_REQUIRE_CHROMIUM")
    with pytest.raises(pytest.skip.Exception):
        chromium()
