"""Abuse: each attack of issue 18, made the way an outsider would, against the real gateway.

The gateway runs on 127.0.0.1 (uvicorn in a thread, or ``kvroute serve`` as a process where
its memory and file descriptors are measured); backends are tiny aiohttp servers that answer
as told. Every loop is bounded; timing margins are 5x or more; memory and descriptor counts
are compared with a baseline taken in the same test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from aiohttp import web

from loadtest.local_fleet import free_port
from proxy.api.app import create_app
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, serve_app, wait_until
from tests.support.threaded_app import ThreadedApp

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
DONE = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
}
EVENT = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'


class Backend(ThreadedApp):
    """A backend in its own thread that answers per ``mode`` and records what it saw."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.mode = mode
        self.hits = 0
        self.headers: list[dict[str, str]] = []
        self.stream_cut_at: float | None = None
        self.redirect_to = ""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.headers.append(dict(request.headers))
        await request.read()
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        if self.mode == "error500":
            return web.Response(status=500, text="boom")
        if self.mode == "no_kv":
            # The documented allocation-failure answer: only these go on a retry key's list.
            return web.json_response(
                {
                    "error": {
                        "message": "cannot allocate KV cache for this request",
                        "type": "kv_cache_allocation_error",
                        "code": "kv_cache_allocation_failed",
                        "param": None,
                    }
                },
                status=503,
            )
        if self.mode == "huge":
            return web.json_response({**DONE, "pad": "x" * (3 << 20)})
        if self.mode == "flood_stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = EVENT * 1000  # ~100 KB per write
            try:
                for _ in range(2000):  # at most ~200 MB: far more than any socket buffer
                    await resp.write(chunk)
            except (ConnectionError, asyncio.CancelledError):
                self.stream_cut_at = time.monotonic()
                raise
            return resp
        return web.json_response(DONE)

    def start(self, redirect_to: str = "") -> Backend:
        app = web.Application()
        self.redirect_to = redirect_to
        app.router.add_post("/v1/chat/completions", self._chat)
        self.serve(app)
        return self


@pytest.fixture
def backends() -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def make(mode: str = "ok", redirect_to: str = "") -> Backend:
        b = Backend(mode).start(redirect_to)
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


def cfg(urls: list[str], **sections: Any) -> Any:
    sections.setdefault("routing", {}).setdefault("policy", "round_robin")
    sections.setdefault("health", {}).setdefault("active", {"enabled": False})
    bs = [{"name": f"b{i}", "url": u, "kind": "contiguous"} for i, u in enumerate(urls)]
    return gateway_cfg(bs, **sections)


def post(url: str, headers: Any = None, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body or BODY, headers=headers, **kw)


def with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("http://", f"http://{userinfo}@")


# --------------------------------------------------------------------------- leaks
def test_error_bodies_and_logs_name_backends_not_urls(
    backends: Callable[..., Backend], caplog: pytest.LogCaptureFixture
) -> None:
    slow = backends("slow")
    c = cfg(
        [with_userinfo(slow.url, "svc:p4ssw0rd")],
        upstream={"ttfb_timeout_s": 0.3},
        retry={"max_attempts": 1},
    )
    with caplog.at_level(logging.INFO), run_gateway(c, run_collector=False) as url:
        r = post(url, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    message = r.json()["error"]["message"]
    assert "b0" in message
    assert "p4ssw0rd" not in r.text and str(slow.port) not in r.text, message
    assert "p4ssw0rd" not in caplog.text


def test_url_credentials_plus_client_authorization_is_not_a_500(
    backends: Callable[..., Backend],
) -> None:
    ok = backends("ok")
    c = cfg([with_userinfo(ok.url, "svc:p4ssw0rd")])
    with run_gateway(c, run_collector=False) as url:
        r = post(url, headers={"Authorization": "Bearer client-token"}, timeout=10)
    assert r.status_code == 200, r.text
    # The backend gets its own credential (the URL's user:pass), not the client's token.
    assert ok.headers[-1]["Authorization"] == "Basic c3ZjOnA0c3N3MHJk"


def test_gateway_credentials_stay_home_and_the_backend_key_goes_instead(
    backends: Callable[..., Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = backends("ok")
    monkeypatch.setenv("KVROUTE_TEST_BACKEND_KEY", "backend-secret")
    c = gateway_cfg(
        [
            {
                "name": "b0",
                "url": ok.url,
                "kind": "contiguous",
                "api_key_env": "KVROUTE_TEST_BACKEND_KEY",
            }
        ],
        routing={"policy": "round_robin"},
        health={"active": {"enabled": False}},
        auth={"api_keys": ["key-one"]},
        admin={"api_key": "admin-key"},
    )
    with run_gateway(c, run_collector=False) as url:
        r = post(url, headers={"Authorization": "Bearer key-one", "X-Admin-Key": "admin-key"})
        assert r.status_code == 200, r.text
        seen = {k.lower(): v for k, v in ok.headers[-1].items()}
        assert seen["authorization"] == "Bearer backend-secret"
        assert "x-admin-key" not in seen
        # Two Authorization headers: which one was checked and which forwarded? Neither.
        dup = post(
            url, headers=[("Authorization", "Bearer key-one"), ("Authorization", "Bearer x")]
        )
        assert dup.status_code == 400 and dup.json()["error"]["code"] == "duplicate_authorization"
        assert ok.hits == 1


def test_hook_output_goes_to_the_log_not_to_the_open_event_log(
    backends: Callable[..., Backend], caplog: pytest.LogCaptureFixture
) -> None:
    ok = backends("ok")
    hook = {
        "type": "command",
        "argv": [sys.executable, "-c", "print('HOOK-SECRET-OUTPUT {url}'); raise SystemExit(3)"],
        "timeout_s": 10,
    }
    fast = {"interval_s": 0.1, "drain_settle_s": 0.1, "min_interval_per_node_s": 0}
    c = cfg(
        [with_userinfo(ok.url, "svc:p4ssw0rd")],
        admin={"api_key": "k"},
        maintenance={**fast, "hook": hook},
    )
    with caplog.at_level(logging.INFO), run_gateway(c, run_collector=False) as url:
        r = httpx.post(url + "/admin/backends/b0/restart?force=true", headers={"x-admin-key": "k"})
        assert r.status_code == 202, r.text

        def events() -> list[dict[str, Any]]:
            got: list[dict[str, Any]] = httpx.get(url + "/fleet/events").json()["events"]
            return got

        wait_until(lambda: any(e["type"] == "restart_failed" for e in events()), what="hook run")
        text = orjson.dumps(events()).decode()
    assert "exit 3" in text
    assert "HOOK-SECRET-OUTPUT" not in text and "p4ssw0rd" not in text
    assert "HOOK-SECRET-OUTPUT" in caplog.text  # the operator still sees it, in the log
    assert "p4ssw0rd" not in caplog.text


# --------------------------------------------------------------------------- headers
def gateway_process(tmp: Path, **limits: Any) -> tuple[subprocess.Popen[bytes], int]:
    """``kvroute serve`` as its own process (its memory and fds are what we measure)."""
    port = free_port()
    conf = {
        "backends": [{"name": "b0", "url": "http://127.0.0.1:9", "kind": "contiguous"}],
        "health": {"active": {"enabled": False}},
        "limits": limits,
    }
    path = tmp / "kvroute.yaml"
    path.write_text(yaml.safe_dump(conf))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, port
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway process did not start")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def tmpdir_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def test_an_endless_header_is_cut_at_the_limit(tmpdir_path: Path) -> None:
    proc, port = gateway_process(tmpdir_path, max_header_bytes=32 * 1024)
    try:
        base = rss_mb(proc.pid)
        piece = b"a" * 65536
        cut_after: list[int] = []
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            sent = 0
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
                while sent < 8 << 20:  # 8 MB per connection if nobody stops us
                    s.sendall(piece)
                    sent += len(piece)
            except OSError:
                pass
            reply = b""
            try:
                reply = s.recv(200)
            except OSError:
                pass
            s.close()
            cut_after.append(sent)
            assert sent < 8 << 20, "the server read 8 MB of one unfinished header"
            assert reply == b"" or reply.startswith(b"HTTP/1.1 431"), reply
        grew = rss_mb(proc.pid) - base
        assert grew < 30, f"RSS grew {grew:.0f} MB for 6 cut connections ({cut_after})"
    finally:
        proc.kill()
        proc.wait(10)


def test_trickled_and_silent_connections_are_timed_out(tmpdir_path: Path) -> None:
    timeout_s = 0.5
    proc, port = gateway_process(tmpdir_path, header_timeout_s=timeout_s)
    socks: list[socket.socket] = []
    try:
        base = fds(proc.pid)
        for i in range(60):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            if i % 2 == 0:  # half send a little of a header, half nothing at all
                s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
            socks.append(s)
        wait_until(lambda: fds(proc.pid) >= base + 50, timeout_s=10, what="connections accepted")
        open_ = set(range(len(socks)))
        deadline = time.monotonic() + 5 * timeout_s + 2
        while open_ and time.monotonic() < deadline:
            for i in list(open_):
                try:
                    if socks[i].recv(1024) == b"":
                        open_.discard(i)
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    open_.discard(i)
                    continue
                try:
                    socks[i].send(b"a")  # one byte at a time, forever if allowed
                except OSError:
                    open_.discard(i)
            time.sleep(0.1)
        assert not open_, f"{len(open_)} of {len(socks)} trickling connections were never cut"
        wait_until(lambda: fds(proc.pid) <= base + 5, timeout_s=5, what="fds back to baseline")
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)


def test_a_body_nobody_reads_cannot_hold_the_connection(backends: Callable[..., Backend]) -> None:
    ok = backends("ok")
    with run_gateway(cfg([ok.url]), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            # /health never reads a body: after its answer, the rest would trickle in forever.
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nab")
            s.setblocking(False)
            got = b""
            closed = False
            for _ in range(50):  # 5 s: a byte every 0.1 s
                try:
                    chunk = s.recv(65536)
                    if chunk == b"":
                        closed = True
                        break
                    got += chunk
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                    break
                try:
                    s.send(b"a")
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
        assert got.startswith(b"HTTP/1.1 "), got[:80]
        assert closed, "the connection stayed open for an unread body trickling in"


# --------------------------------------------------------------------------- bodies
def slow_body(port: int, declared: int, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
        + first
    )
    return s


def reply(s: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (bounded by ``timeout_s``)."""
    s.settimeout(timeout_s)
    raw = b""
    try:
        while len(raw) < 1 << 20 and (chunk := s.recv(65536)):
            raw += chunk
    except OSError:
        pass
    return raw


def test_slow_bodies_hold_no_slot(backends: Callable[..., Backend]) -> None:
    ok = backends("ok")
    with run_gateway(
        cfg([ok.url], limits={"max_concurrent_requests": 4}), run_collector=False
    ) as url:
        port = int(url.rsplit(":", 1)[1])
        slow = [slow_body(port, 100_000, b'{"model": "m"') for _ in range(8)]
        try:
            time.sleep(0.2)
            # Eight trickling bodies, four slots: a real request still gets one.
            r = post(url, timeout=10)
            assert r.status_code == 200, r.text
        finally:
            for s in slow:
                s.close()


def test_slow_bodies_are_cut(backends: Callable[..., Backend]) -> None:
    ok = backends("ok")
    timeout_s = 0.5
    c = cfg([ok.url], limits={"body_timeout_s": timeout_s, "body_min_rate_bytes_s": 4096})
    with run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        slow = [slow_body(port, 100_000, b'{"model": "m"') for _ in range(8)]
        try:
            for s in slow:
                head = reply(s, 5 * timeout_s + 2)
                assert head.startswith(b"HTTP/1.1 408"), head[:80]
                assert b"request_timeout" in head
        finally:
            for s in slow:
                s.close()


def trickle_until_answered(s: socket.socket, n_bytes: int, gap_s: float) -> tuple[bytes, int]:
    """Send ``n_bytes`` one at a time, ``gap_s`` apart, until the server answers or closes.

    Returns what the server sent and how many bytes of the body had gone out by then.
    """
    sent = 0
    s.setblocking(False)
    try:
        while sent < n_bytes:
            try:
                if s.recv(1, socket.MSG_PEEK):
                    break
                break  # b"": the server closed the connection
            except BlockingIOError:
                pass
            try:
                s.send(b" ")
            except OSError:
                break
            sent += 1
            time.sleep(gap_s)
    finally:
        s.setblocking(True)
    return reply(s, 10), sent


def test_a_trickled_body_is_cut_by_the_whole_bodys_deadline(
    backends: Callable[..., Backend],
) -> None:
    # One byte per 0.2 s resets any per-chunk timeout, so only a deadline for the whole body
    # (0.5 s plus a second per 4 KB received) can cut it: after ~3 bytes, long before the
    # 30 declared bytes (6 s) have arrived. A deadline that restarts on every chunk lets it in.
    ok = backends("ok")
    c = cfg([ok.url], limits={"body_timeout_s": 0.5, "body_min_rate_bytes_s": 4096})
    with run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        head = b'{"model": "m"}'
        s = slow_body(port, len(head) + 30, head)
        try:
            answer, sent = trickle_until_answered(s, 30, 0.2)
        finally:
            s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer
        assert sent < 30, "the whole trickled body was accepted"


def test_bytes_buffered_across_requests_are_bounded(backends: Callable[..., Backend]) -> None:
    ok = backends("ok")
    c = cfg([ok.url], limits={"max_buffered_body_bytes": 1 << 20, "body_timeout_s": 30})
    with run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        part = b'{"model": "m", "pad": "' + b"x" * 300_000
        held = [slow_body(port, 4_000_000, part) for _ in range(3)]  # ~900 KB held
        try:
            time.sleep(0.3)
            over = slow_body(port, 4_000_000, part)
            head = reply(over, 10)
            over.close()
            assert head.startswith(b"HTTP/1.1 429") and b"too_many_request_bodies" in head, head[
                :200
            ]
        finally:
            for s in held:
                s.close()
        # Once those bodies are gone the budget is back.
        wait_until(lambda: post(url, timeout=10).status_code == 200, what="budget released")


# --------------------------------------------------------------------------- streams
def test_a_stream_whose_client_stops_reading_is_cut_at_the_total_timeout(
    backends: Callable[..., Backend],
) -> None:
    flood = backends("flood_stream")
    total = 1.0
    c = cfg([flood.url], upstream={"total_timeout_s": total, "idle_timeout_s": total})
    with run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        body = orjson.dumps({**BODY, "stream": True})
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        try:
            # The client reads nothing more; the gateway must give up by itself.
            wait_until(lambda: flood.stream_cut_at is not None, timeout_s=5 * total + 5, what="cut")
            assert flood.stream_cut_at is not None and flood.stream_cut_at - started < 5 * total + 5
            wait_until(
                lambda: all(
                    b["overlay"]["inflight"] == 0 and b["overlay"]["reserved_tokens"] == 0
                    for b in fleet_state(url)["backends"]
                ),
                what="reservation released",
            )
        finally:
            s.close()


# --------------------------------------------------------------------------- retry keys
def test_retry_keys_are_namespaced_by_client(backends: Callable[..., Backend]) -> None:
    flaky = backends("no_kv")
    c = cfg(
        [flaky.url],
        auth={"api_keys": ["attacker", "victim"]},
        retry={"max_attempts": 1},
        health={"outlier": {"consecutive_failures": 100}},
    )
    with run_gateway(c, run_collector=False) as url:
        key = {"Idempotency-Key": "victim-order-42"}
        bad = post(url, headers={"Authorization": "Bearer attacker", **key})
        assert bad.status_code == 503, bad.text
        flaky.mode = "ok"
        time.sleep(0.2)  # the failure is recorded off the answer's path
        # The same key from another client is a different request: it is served.
        r = post(url, headers={"Authorization": "Bearer victim", **key})
        assert r.status_code == 200, r.text
        # The attacker's own retry still avoids the node that failed it (the feature stays).
        again = post(url, headers={"Authorization": "Bearer attacker", **key})
        assert again.status_code == 503, again.text


# --------------------------------------------------------------------------- answers
def test_redirects_are_not_followed(backends: Callable[..., Backend]) -> None:
    elsewhere = backends("ok")
    redirecting = backends("redirect", redirect_to=elsewhere.url + "/v1/chat/completions")
    c = cfg([redirecting.url], retry={"max_attempts": 1})
    with run_gateway(c, run_collector=False) as url:
        r = post(url, timeout=10)
    assert elsewhere.hits == 0, "the prompt was re-posted to the redirect's target"
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_response"


def test_whole_answers_are_read_with_a_size_cap(backends: Callable[..., Backend]) -> None:
    huge = backends("huge")
    c = cfg([huge.url], retry={"max_attempts": 1}, upstream={"max_answer_bytes": 1 << 20})
    with run_gateway(c, run_collector=False) as url:
        r = post(url, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_response"
    assert len(r.content) < 4096


def test_request_id_is_bounded_and_sanitized(
    backends: Callable[..., Backend], caplog: pytest.LogCaptureFixture
) -> None:
    broken = backends("error500")
    c = cfg([broken.url], retry={"max_attempts": 1})
    with caplog.at_level(logging.INFO), run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        rid = b"id-" + b"A" * 5000 + b"\t\x80\xff" + b"FAKE-LINE"
        body = orjson.dumps(BODY)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"X-Request-Id: "
                + rid
                + f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    echoed = next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("x-request-id:")
    )
    assert 0 < len(echoed) <= 128 and echoed.isascii() and echoed.isprintable(), echoed[:80]
    assert "A" * 200 not in caplog.text


# --------------------------------------------------------------------------- open reads
def test_a_flood_of_advice_costs_one_computation_per_second(
    backends: Callable[..., Backend],
) -> None:
    ok = backends("ok")
    c = cfg([ok.url])
    app = create_app(c, run_collector=False)
    with serve_app(app, c) as url:
        ops = app.state.ops
        calls = {"n": 0}
        real = ops.evaluate

        async def counted() -> Any:
            calls["n"] += 1
            return await real()

        ops.evaluate = counted

        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:
                rs = await asyncio.gather(*(client.get(url + "/fleet/advice") for _ in range(200)))
            return [r.status_code for r in rs]

        started = time.monotonic()
        statuses = asyncio.run(flood())
        elapsed = time.monotonic() - started
    assert set(statuses) == {200}
    # The maintenance loop evaluates too (every interval_s); the flood adds about one per second.
    assert calls["n"] <= 3 + 2 * elapsed, (calls["n"], elapsed)


def test_openapi_document_needs_the_admin_key(backends: Callable[..., Backend]) -> None:
    ok = backends("ok")
    with run_gateway(cfg([ok.url]), run_collector=False) as url:
        assert httpx.get(url + "/openapi.json").status_code == 404
        assert httpx.get(url + "/docs").status_code == 404
    with run_gateway(cfg([ok.url], admin={"api_key": "k"}), run_collector=False) as url:
        assert httpx.get(url + "/openapi.json").status_code == 401
        r = httpx.get(url + "/openapi.json", headers={"x-admin-key": "k"})
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


ODD_HEADERS: list[list[bytes]] = [
    [b"Authorization: Bearer client-token"],
    [b"Authorization: Bearer caf\xe9\xff"],
    [b"Authorization: "],
    [b"Authorization: Basic", b"Authorization: Bearer x"],
    [b"X-Note: \xe9\xff\x80"],
    [b"Idempotency-Key: caf\xe9 \xff"],
    [b"X-Request-Id: "],
    [b"Content-Type: application/json", b"Content-Type: text/plain"],
    [b"Expect: 100-continue"],
    [b"Connection: keep-alive, authorization, x-admin-key"],
    [b"X-Admin-Key: a", b"X-Admin-Key: b"],
    [b"Proxy-Authorization: Basic eA=="],
    [b"Cookie: " + b"c=" + b"x" * 20_000],
    [b"TE: trailers", b"Upgrade: h2c", b"Connection: Upgrade"],
]


@pytest.mark.parametrize("auth", [False, True])
def test_no_header_combination_is_a_500(backends: Callable[..., Backend], auth: bool) -> None:
    ok = backends("ok")
    sections: dict[str, Any] = {"auth": {"api_keys": ["client-token"]}} if auth else {}
    c = cfg([with_userinfo(ok.url, "svc:p4ssw0rd")], **sections)
    body = orjson.dumps(BODY)
    with run_gateway(c, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        for extra in ODD_HEADERS:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    + b"".join(h + b"\r\n" for h in extra)
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                raw = reply(s, 10).removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
            status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0
            assert 200 <= status < 500, (extra, raw[:300])
            head, _, rest = raw.partition(b"\r\n\r\n")
            # A backend's own 4xx is relayed as it is; the gateway's are OpenAI errors.
            if status >= 400 and b"x-kvroute-backend" not in head.lower():
                payload = orjson.loads(rest)
                assert set(payload["error"]) >= {"message", "type", "code"}, (extra, payload)
