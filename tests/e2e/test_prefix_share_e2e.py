"""Two real gateway replicas on one real redis-server agree where a document is when sharing is on.

Two vLLM-mode engines, two gateways (same config, same Redis store). A blocker, sent
through replica A, makes v0 the busier node, so the first question about a document, also
through A, lands on v1. Once the blocker is gone, the fit order alone picks v0. The
follow-up goes through replica B: with ``routing.prefix.share`` B has learned A's placement
from the shared stream and sends it to v1 (served from the engine's prefix cache), and the
session of the first question follows it there too; without sharing B has never seen the
document and sends both to v0. The two cases tell the rules apart.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.api.app import create_app
from proxy.config import load_config
from tests.e2e import test_prefix_e2e
from tests.e2e.test_prefix_e2e import (
    Background,
    chat,
    hits,
    idle_reports,
    inflight,
    post,
    question,
)
from tests.support.gateway import gateway_cfg, run_gateway, serve_app, wait_until

POLL_S = 0.05


# The same two vLLM-mode engines as the single-gateway prefix e2e tests.
engines = test_prefix_e2e.engines


def reported(gw: str) -> bool:
    return all(b.get("report") for b in httpx.get(gw + "/fleet").json()["backends"])


@pytest.mark.parametrize("share", [True, False])
def test_two_replicas_on_redis_agree_where_the_document_is_when_sharing_is_on(
    engines: list[str], redis_server: str, share: bool
) -> None:
    backends = [{"name": f"v{i}", "url": u, "kind": "vllm"} for i, u in enumerate(engines)]
    cfg = gateway_cfg(
        backends,
        routing={"prefix": {"share": share, "share_poll_s": POLL_S}},
        store={"redis_url": redis_server, "key_prefix": "share-" + secrets.token_hex(4)},
        queue={"max_wait_s": 5.0},
    )
    with run_gateway(cfg) as a, run_gateway(cfg) as b:
        for gw in (a, b):
            wait_until(lambda gw=gw: reported(gw), what="both engines reported")
        blocker = Background(a, chat("hold on", max_tokens=4_000))
        assert blocker.backend == "v0"
        assert post(a, question(1), {"x-session-id": "s1"}) == "v1"
        blocker.stop()
        for gw in (a, b):
            wait_until(lambda gw=gw: inflight(gw) == 0, what="the blocker released")
            wait_until(lambda gw=gw: idle_reports(gw), what="reports without the blocker")
        # B reads the stream every POLL_S: 20 rounds are ample (sharing on) and changes
        # nothing when it is off.
        time.sleep(20 * POLL_S)
        # The session of the first question (placed by A) follows it through B...
        assert post(b, chat("thanks!"), {"x-session-id": "s1"}) == ("v1" if share else "v0")
        for gw in (a, b):
            wait_until(lambda gw=gw: idle_reports(gw), what="reports after the chat")
        # ...and so does the follow-up question, served from v1's prefix cache (~6,000 tokens).
        before = hits(engines[1])
        assert post(b, question(2)) == ("v1" if share else "v0")
        if share:
            assert hits(engines[1]) - before > 5_000


def test_a_reload_with_new_prefix_settings_keeps_sharing(
    tmp_path: Path, engines: list[str], redis_server: str
) -> None:
    path = tmp_path / "kvroute.yaml"

    def write(min_saving: int) -> None:
        data = {
            "backends": [
                {"name": f"v{i}", "url": u, "kind": "vllm"} for i, u in enumerate(engines)
            ],
            "routing": {"prefix": {"share_poll_s": POLL_S, "min_saving_tokens": min_saving}},
            "store": {"redis_url": redis_server, "key_prefix": "reload-" + secrets.token_hex(4)},
            "collector": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
            "admin": {"api_key": "adm-key"},
        }
        path.write_text(yaml.safe_dump(data))

    write(512)
    cfg = load_config(path, environ={})
    app = create_app(cfg, config_path=str(path))
    with serve_app(app, cfg) as gw:
        wait_until(lambda: reported(gw), what="both engines reported")
        share = app.state.prefix_share
        assert share is not None
        before = app.state.rt.gateway.affinity
        write(1024)
        r = httpx.post(gw + "/admin/reload", headers={"Authorization": "Bearer adm-key"})
        assert r.status_code == 200, r.text
        after = app.state.rt.gateway.affinity
        # A fresh index for the new settings, still publishing to the same stream.
        assert after is not before and after.share is share
        sent = share.published
        post(gw, question(7))
        wait_until(lambda: share.published > sent, what="the placement shared after the reload")
