"""The lean path (proxy.api.entry) answers like the ASGI stack, over real HTTP.

A real gateway on uvicorn in front of a simulated engine; raw sockets where a client's
behaviour matters (pipelining, Expect, leaving mid-stream). ``KVROUTE_LEAN=0`` serves the
same requests through the ASGI stack, the reference each lean answer is compared with.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.api.entry import LeanPath
from proxy.config import Config
from proxy.gateway.walk import Gateway
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
KEY = "sk-test-key"


def _cfg(url: str, **sections: Any) -> Config:
    sections.setdefault("health", {}).setdefault("active", {"enabled": False})
    sections.setdefault("routing", {}).setdefault("policy", "round_robin")
    return gateway_cfg([{"name": "a", "url": url, "kind": "contiguous"}], **sections)


@pytest.fixture
def engine(engine_factory: Callable[..., Any]) -> Any:
    return engine_factory(name="a")


@pytest.fixture
def lean_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths the lean path served (LeanPath.run wrapped to record them)."""
    seen: list[str] = []
    real = LeanPath.run

    async def counted(self: LeanPath, cycle: Any, transport: Any, handler: Any) -> None:
        seen.append(cycle.scope["path"])
        await real(self, cycle, transport, handler)

    monkeypatch.setattr(LeanPath, "run", counted)
    yield seen


def _exchange(cfg: Config, requests: list[dict[str, Any]]) -> list[httpx.Response]:
    with run_gateway(cfg, run_collector=False) as url, httpx.Client(base_url=url) as client:
        return [client.request(**r) for r in requests]


def _shape(r: httpx.Response) -> tuple[int, str | None, list[str]]:
    """What must match between the two paths: status, error code, header names (not date)."""
    code = None
    if r.headers.get("content-type", "").startswith("application/json") and r.status_code >= 400:
        code = r.json()["error"]["code"]
    names = sorted(
        k for k in r.headers if k not in ("date", "x-request-id") and not k.startswith("x-kvroute")
    )
    return r.status_code, code, names


def test_the_inference_posts_take_the_lean_path(engine: Any, lean_runs: list[str]) -> None:
    with run_gateway(_cfg(engine.url), run_collector=False) as url:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc"})
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion"
        assert r.headers["x-request-id"] == "abc" and r.headers["x-kvroute-backend"] == "a"
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        assert httpx.get(url + "/fleet").status_code == 200
        assert httpx.get(url + "/v1/chat/completions").status_code == 405
    assert lean_runs == ["/v1/chat/completions", "/v1/completions"]


def test_lean_off_serves_through_the_asgi_stack(
    engine: Any, lean_runs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_LEAN", "0")
    with run_gateway(_cfg(engine.url), run_collector=False) as url:
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert lean_runs == []


@pytest.mark.parametrize("stream", [False, True])
def test_the_access_log_line_is_the_same_on_both_paths(
    engine: Any,
    stream: bool,
    lean_runs: list[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level("INFO", logger="kvroute.access")
    cfg = _cfg(engine.url, log={"access_log": True})
    body = {**CHAT, "stream": stream}
    lines = []
    for lean in ("1", "0"):
        monkeypatch.setenv("KVROUTE_LEAN", lean)
        caplog.clear()
        with run_gateway(cfg, run_collector=False) as url:
            r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": "r1"})
            assert r.status_code == 200
            bad = httpx.post(
                url + "/v1/chat/completions", content=b"{", headers={"x-request-id": "r2"}
            )
            assert bad.status_code == 400
            # The line is written once the answer has gone out: wait for it.
            wait_until(lambda: len(caplog.records) >= 2, what="two access lines")
        got = [rec.__dict__["access"] for rec in caplog.records if rec.name == "kvroute.access"]
        lines.append([{k: v for k, v in a.items() if k != "duration_ms"} for a in got])
    assert lean_runs == ["/v1/chat/completions"] * 2
    assert lines[0] == lines[1]
    ok, refused = lines[0]
    assert (
        ok["id"] == "r1" and ok["model"] == "m" and ok["backend"] == "a" and ok["status"] == "200"
    )
    assert refused["id"] == "r2" and refused["status"] == "400"


def test_forwarded_headers_are_honoured_alike_on_both_paths(
    engine: Any, lean_runs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn's proxy-header layer (127.0.0.1 trusted by default) on the lean path: run for a
    request that carries X-Forwarded-*, skipped for one that does not, as the stack does."""
    seen: list[tuple[str, str]] = []
    real = Gateway.handle

    async def recorded(self: Gateway, request: Any, endpoint: Any) -> Any:
        client = request.client
        seen.append((client.host if client else "-", request.url.scheme))
        return await real(self, request, endpoint)

    monkeypatch.setattr(Gateway, "handle", recorded)
    forwarded = {"x-forwarded-for": "203.0.113.9", "x-forwarded-proto": "https"}
    runs = []
    for lean in ("1", "0"):
        monkeypatch.setenv("KVROUTE_LEAN", lean)
        seen.clear()
        with run_gateway(_cfg(engine.url), run_collector=False) as url:
            for headers in (forwarded, {}):
                r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 200, r.text
        runs.append(list(seen))
    assert lean_runs == ["/v1/chat/completions"] * 2
    assert runs[0] == runs[1] == [("203.0.113.9", "https"), ("127.0.0.1", "http")]


def bad_requests() -> list[dict[str, Any]]:
    """One good request, then bad input of each kind (fresh each call: one holds a generator)."""
    return [
        {"method": "POST", "url": "/v1/chat/completions", "json": CHAT},
        {"method": "POST", "url": "/v1/chat/completions", "content": b"{"},
        {"method": "POST", "url": "/v1/chat/completions", "json": {"model": "m"}},
        {"method": "POST", "url": "/v1/completions", "json": {"model": "m", "prompt": 3}},
        # Refused before the body is read (then the connection closes): no body, so that a
        # body still arriving cannot make the closing socket reset the connection.
        {"method": "POST", "url": "/v1/chat/completions", "headers": {"authorization": "Bearer x"}},
        {
            "method": "POST",
            "url": "/v1/chat/completions",
            "headers": [("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")],
        },
        {
            "method": "POST",
            "url": "/v1/chat/completions",
            # A generator: chunked, no Content-Length, over the limit only as it arrives.
            "content": (b"x" * 1000 for _ in range(5)),
        },
        {"method": "POST", "url": "/v1/chat/completions", "headers": {"x-big": "y" * 9000}},
    ]


@pytest.mark.parametrize("keys", [False, True])
def test_bad_input_is_answered_alike_on_both_paths(
    engine: Any, keys: bool, monkeypatch: pytest.MonkeyPatch, lean_runs: list[str]
) -> None:
    sections: dict[str, Any] = {"limits": {"max_body_bytes": 4096, "max_header_bytes": 8192}}
    if keys:
        sections["auth"] = {"api_keys": [KEY]}
    cfg = _cfg(engine.url, **sections)
    good = {"authorization": f"Bearer {KEY}"} if keys else {}

    def requests() -> list[dict[str, Any]]:
        out = bad_requests()
        for r in out:
            if isinstance(r.get("headers", {}), dict):
                r["headers"] = {**good, **r.get("headers", {})}
        return out

    lean = _exchange(cfg, requests())
    assert len(lean_runs) > 0
    monkeypatch.setenv("KVROUTE_LEAN", "0")
    plain = _exchange(cfg, requests())
    assert [_shape(r) for r in lean] == [_shape(r) for r in plain]
    statuses = [r.status_code for r in lean]
    if keys:
        assert statuses == [200, 400, 400, 400, 401, 400, 413, 431]
    else:
        # No key needed: the body-less request is a 400 for its (empty) body.
        assert statuses == [200, 400, 400, 400, 400, 400, 413, 431]
    # Each refused for its own reason (the key, then the duplicate Authorization header).
    codes = [r.json()["error"].get("code") if r.status_code >= 400 else None for r in lean]
    if keys:
        assert codes[4] == "invalid_api_key", codes
    assert codes[5] == "duplicate_authorization", codes
    for r in lean[1:]:
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["type"], err


def _raw(port: int, data: bytes, timeout_s: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    s.sendall(data)
    return s


def _request(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _read_answers(s: socket.socket, n: int) -> list[tuple[bytes, bytes]]:
    """``n`` whole answers (head, body) read off one connection, framed by Content-Length."""
    buf = b""
    out: list[tuple[bytes, bytes]] = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"closed after {len(out)} answers"
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        out.append((head, rest[:length]))
        buf = rest[length:]
    return out


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_declared_body_over_the_limit_is_a_413(
    engine: Any, lean: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_LEAN", lean)
    with run_gateway(_cfg(engine.url, limits={"max_body_bytes": 4096}), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        # Head and body in one write: the refusal comes after the whole request arrived.
        with _raw(port, _request(b"x" * 5000)) as s:
            ((head, body),) = _read_answers(s, 1)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert orjson.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(
    engine: Any, lean: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the head goes out, declaring 1 MB against a 4 KB limit: the 413 must come on the
    # declaration alone. A gateway that waits for the body answers 408 when its timeout ends.
    monkeypatch.setenv("KVROUTE_LEAN", lean)
    limits = {"max_body_bytes": 4096, "body_timeout_s": 5}
    with run_gateway(_cfg(engine.url, limits=limits), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        head = _request(b"x" * 1_000_000)[:-1_000_000]
        with _raw(port, head) as s:
            ((answer, body),) = _read_answers(s, 1)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert orjson.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("lean", ["1", "0"])
def test_an_answer_before_the_body_ends_says_connection_close(
    engine: Any, lean: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused on its headers, its body not yet sent: the answer must say the connection
    closes. Without it a client sent its next request down that connection and met a reset
    (a CI failure in the fuzz tests)."""
    monkeypatch.setenv("KVROUTE_LEAN", lean)
    cfg = _cfg(engine.url, auth={"api_keys": [KEY]})
    with run_gateway(cfg, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        body = orjson.dumps(CHAT)
        head = _request(body, b"authorization: Bearer wrong\r\n")[: -len(body)]
        with _raw(port, head) as s:
            ((answer, _),) = _read_answers(s, 1)
            assert answer.startswith(b"HTTP/1.1 401"), answer
            assert b"\r\nconnection: close" in answer.lower(), answer
            s.sendall(body)  # the body, late: read and dropped, then a clean close
            assert s.recv(65536) == b""


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_client_sending_a_body_over_the_limit_reads_its_413(
    engine: Any, lean: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends its whole body before reading (as httpx and most clients do)
    must read the 413, not a reset: closing with the body unread made the kernel reset the
    connection, and the answer was lost with it."""
    monkeypatch.setenv("KVROUTE_LEAN", lean)
    with run_gateway(_cfg(engine.url, limits={"max_body_bytes": 4096}), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        head = _request(b"", f"content-length: {8 << 20}\r\n".encode())
        head = head.replace(b"Content-Length: 0\r\n", b"")
        with _raw(port, head) as s:
            time.sleep(0.2)  # the 413 is out before most of the body is sent
            s.sendall(b"x" * (8 << 20))
            ((answer, body),) = _read_answers(s, 1)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"\r\nconnection: close" in answer.lower(), answer
    assert orjson.loads(body)["error"]["code"] == "request_too_large"


def test_pipelined_requests_on_one_connection_are_answered_in_order(engine: Any) -> None:
    with run_gateway(_cfg(engine.url), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        first = _request(orjson.dumps(CHAT), b"x-request-id: one\r\n")
        second = _request(b"{", b"x-request-id: two\r\n")
        third = _request(orjson.dumps(CHAT), b"x-request-id: three\r\n")
        with _raw(port, first + second + third) as s:
            answers = _read_answers(s, 3)
    heads = [h.lower() for h, _ in answers]
    assert heads[0].startswith(b"http/1.1 200") and b"x-request-id: one" in heads[0]
    assert heads[1].startswith(b"http/1.1 400") and b"x-request-id: two" in heads[1]
    assert heads[2].startswith(b"http/1.1 200") and b"x-request-id: three" in heads[2]
    assert orjson.loads(answers[0][1])["object"] == "chat.completion"


def test_connection_close_is_honoured(engine: Any) -> None:
    with run_gateway(_cfg(engine.url), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        with _raw(port, _request(orjson.dumps(CHAT), b"Connection: close\r\n")) as s:
            ((head, _),) = _read_answers(s, 1)
            s.settimeout(5)
            assert s.recv(1) == b"", "the connection stayed open"
    assert b"connection: close" in head.lower()


def test_expect_continue_gets_its_interim_answer(engine: Any) -> None:
    body = orjson.dumps(CHAT)
    with run_gateway(_cfg(engine.url), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        head = _request(b"", b"Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", f"Content-Length: {len(body)}".encode()
        )
        with _raw(port, head) as s:
            got = s.recv(1024)
            assert got.startswith(b"HTTP/1.1 100"), got
            s.sendall(body)
            ((answer, _),) = _read_answers(s, 1)
    assert answer.startswith(b"HTTP/1.1 200"), answer


def _settled(url: str) -> bool:
    return all(
        b["overlay"]["inflight"] == 0 and b["overlay"]["reserved_tokens"] == 0
        for b in fleet_state(url)["backends"]
    )


def test_a_client_leaving_mid_stream_leaves_no_reservation(
    engine_factory: Callable[..., Any], lean_runs: list[str]
) -> None:
    slow = engine_factory(name="a", speedup=1.0, chunk_interval_s=0.02)
    body = orjson.dumps({**CHAT, "max_tokens": 2000, "stream": True})
    with run_gateway(_cfg(slow.url), run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        with _raw(port, _request(body)) as s:
            got = b""
            while got.count(b"data:") < 2:
                got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            assert not _settled(url), "the stream holds a reservation while it runs"
        # The client is gone: the reservation and the concurrency slot go with it.
        wait_until(lambda: _settled(url), timeout_s=10, what="reservation released")
    assert lean_runs == ["/v1/chat/completions"]


def test_the_concurrency_limit_holds_on_the_lean_path(
    engine_factory: Callable[..., Any],
) -> None:
    slow = engine_factory(name="a", speedup=1.0, chunk_interval_s=0.02)
    body = orjson.dumps({**CHAT, "max_tokens": 2000, "stream": True})
    cfg = _cfg(slow.url, limits={"max_concurrent_requests": 1})
    with run_gateway(cfg, run_collector=False) as url:
        port = int(url.rsplit(":", 1)[1])
        with _raw(port, _request(body)) as s:
            got = b""
            while b"data:" not in got:
                got += s.recv(65536)
            r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "too_many_concurrent_requests"
            assert r.headers["retry-after"]
        # The slot comes back once the stream's client has gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10)
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text


def test_a_whole_stream_arrives_in_order(engine: Any, lean_runs: list[str]) -> None:
    body = {**CHAT, "max_tokens": 40, "stream": True}
    with run_gateway(_cfg(engine.url), run_collector=False) as url, httpx.Client() as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["transfer-encoding"] == "chunked"
            assert r.headers["x-kvroute-backend"] == "a"
            text = b"".join(r.iter_bytes()).decode()
        # A second request on the same connection: the stream ended cleanly.
        assert client.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: _settled(url), what="reservation released")
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    words = "".join(
        c["delta"].get("content") or ""
        for e in events[:-1]
        for c in orjson.loads(e.removeprefix("data: "))["choices"]
    )
    assert words, text[:200]
    assert lean_runs == ["/v1/chat/completions", "/v1/chat/completions"]
