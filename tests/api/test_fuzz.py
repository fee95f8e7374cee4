"""Hostile client input against the real gateway: no 5xx, every error in the OpenAI format.

The gateway runs on uvicorn (in a thread) in front of a real simulated engine; inputs come
from hypothesis (bodies, raw bytes, headers), from schemathesis (the gateway's own OpenAPI
document, valid and invalid data), and from a list of named nasty cases. Generation length
is bounded by ``routing.max_tokens_limit`` so that no example runs long.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from proxy.api.app import create_app
from tests.support.engines import start_engine
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

PATHS = ("/v1/chat/completions", "/v1/completions")


def dumps(data: Any) -> bytes:
    """The stdlib encoder: big integers, and NaN/Infinity (which are not JSON) go through as written."""
    return json.dumps(data).encode()


FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    engine = start_engine("thread", name="fuzz-engine", strict_model=True, default_max_tokens=8)
    cfg = gateway_cfg(
        [{"name": "fuzz-engine", "url": engine.url, "kind": "contiguous"}],
        routing={"max_tokens_limit": 64, "default_max_tokens": 16},
        queue={"max_wait_s": 0.2},
    )
    try:
        with run_gateway(cfg) as url:
            wait_until(
                lambda: bool(fleet_state(url)["backends"][0]["report"]), what="engine report"
            )
            yield url
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def client(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=60, trust_env=False) as c:
        yield c


def assert_answer_ok(resp: httpx.Response) -> None:
    """The invariant for any client input: not a 5xx; an error is an OpenAI error object."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and "code" in err and "param" in err, err
        assert "Traceback" not in resp.text and 'File "' not in resp.text
    elif resp.headers.get("content-type", "").startswith("application/json"):
        assert isinstance(resp.json(), dict)


def no_reservation_left(url: str) -> None:
    """Nothing reserved: the gateway's own ledger (held, queued releases) and the store's view.

    Reservations live 900 s here (the default TTL), far beyond this wait: a reservation that
    is never released is still there when the check looks."""
    seen: list[Any] = []

    def empty() -> bool:
        st = fleet_state(url)
        seen[:] = [st["reservations"], st["backends"][0]["overlay"]["inflight"]]
        return seen == [{"held": 0, "pending_releases": 0}, 0]

    try:
        wait_until(empty, timeout_s=10, what="reservations released")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen (ledger, in flight): {seen}") from None


@pytest.fixture(autouse=True)
def leaves_no_reservation(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test of this module, whatever ran and in whatever order: nothing reserved."""
    yield
    if "gateway" in request.fixturenames:
        no_reservation_left(request.getfixturevalue("gateway"))


# --------------------------------------------------------------------------- hypothesis
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
roles = st.sampled_from(
    ["system", "user", "assistant", "tool", "developer", "function", "", "admin", "USER"]
)
content = (
    st.text(max_size=200)
    | st.none()
    | st.integers()
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "x"])},
            optional={"text": st.text(max_size=30) | st.integers()},
        ),
        max_size=3,
    )
)
message = st.fixed_dictionaries(
    {}, optional={"role": roles, "content": content, "name": st.text(max_size=10) | st.integers()}
)
number = (
    st.none()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=5)
    | st.booleans()
)
chat_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=30) | st.sampled_from(["sim-model", "unknown-model"]) | json_leaf,
        "messages": st.lists(message, max_size=4) | json_any,
        "max_tokens": number,
        "max_completion_tokens": number,
        "n": number,
        "stream": st.booleans() | json_leaf,
        "temperature": number,
        "extra": json_any,
    },
)
completion_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["sim-model", "nope"]) | json_leaf,
        "prompt": st.text(max_size=200)
        | st.lists(st.text(max_size=20), max_size=3)
        | st.lists(st.integers(min_value=-5, max_value=200_000), max_size=5)
        | json_any,
        "max_tokens": number,
        "stream": st.booleans() | json_leaf,
    },
)
# Any value a client library will send (no CR/LF, no surrounding whitespace: h11 refuses those).
header_text = st.text(
    alphabet=string.printable.replace("\r", "")
    .replace("\n", "")
    .replace("\x0b", "")
    .replace("\x0c", ""),
    max_size=60,
).map(lambda s: s.strip(" \t"))


@FUZZ
@given(data=chat_body)
def test_fuzz_chat_bodies(client: httpx.Client, data: dict[str, Any]) -> None:
    assert_answer_ok(
        client.post(
            "/v1/chat/completions",
            content=dumps(data),
            headers={"content-type": "application/json"},
        )
    )


@FUZZ
@given(data=completion_body)
def test_fuzz_completion_bodies(client: httpx.Client, data: dict[str, Any]) -> None:
    assert_answer_ok(
        client.post(
            "/v1/completions", content=dumps(data), headers={"content-type": "application/json"}
        )
    )


@FUZZ
@given(raw=st.binary(max_size=300) | json_any.map(dumps), path=st.sampled_from(PATHS))
def test_fuzz_raw_bytes(client: httpx.Client, raw: bytes, path: str) -> None:
    assert_answer_ok(client.post(path, content=raw, headers={"content-type": "application/json"}))


@FUZZ
@given(
    ctype=st.sampled_from(
        [
            "application/json",
            "text/plain",
            "",
            "application/json; charset=utf-8",
            "multipart/form-data",
            "application/x-www-form-urlencoded",
            "application/vnd.api+json",
        ]
    )
    | header_text,
    extra=st.dictionaries(
        st.sampled_from(
            [
                "authorization",
                "x-request-id",
                "idempotency-key",
                "connection",
                "te",
                "x-custom",
                "accept",
                "upgrade",
            ]
        ),
        header_text,
        max_size=4,
    ),
)
def test_fuzz_headers(
    client: httpx.Client, gateway: str, ctype: str, extra: dict[str, str]
) -> None:
    headers = {"content-type": ctype, **extra}
    resp = client.post(
        "/v1/chat/completions",
        content=orjson.dumps(
            {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ),
        headers=headers,
    )
    assert_answer_ok(resp)


def test_fuzz_left_no_reservation(client: httpx.Client, gateway: str) -> None:
    """Answers of every kind (whole, streamed, refused, broken off by the client) leave nothing
    reserved; on its own, not only after the rest of the module."""
    ok = {"model": "sim-model", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200
    streamed = client.post("/v1/chat/completions", json={**ok, "stream": True})
    assert streamed.status_code == 200 and b"[DONE]" in streamed.content
    assert (
        client.post("/v1/completions", json={"model": "sim-model", "prompt": "x"}).status_code
        == 200
    )
    assert client.post("/v1/chat/completions", json={**ok, "max_tokens": -1}).status_code == 400
    assert (
        client.post("/v1/chat/completions", json={**ok, "model": "unknown-model"}).status_code < 500
    )
    with client.stream("POST", "/v1/chat/completions", json={**ok, "stream": True}) as resp:
        for _ in resp.iter_raw():
            break  # the client leaves after the first bytes
    no_reservation_left(gateway)


# --------------------------------------------------------------------------- named cases
NESTED = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize(
    ("name", "raw", "status", "code"),
    [
        (
            "invalid utf-8 in a string",
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}',
            400,
            "invalid_json",
        ),
        ("invalid utf-8 bare", b"\xff\xfe\xfd", 400, "invalid_json"),
        (
            "lone surrogate escape",
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
            None,
            None,
        ),
        ("deeply nested array", NESTED, 400, "invalid_json"),
        (
            "deeply nested content",
            b'{"model":"m","messages":[{"role":"user","content":'
            + b"[" * 5000
            + b"]" * 5000
            + b"}]}",
            400,
            None,
        ),
        (
            "huge integer max_tokens",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":123456789012345678901234567890}',
            400,
            None,
        ),
        (
            "huge float max_tokens",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1e400}',
            400,
            None,
        ),
        (
            "negative zero max_tokens",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-0.0}',
            400,
            None,
        ),
        (
            "float max_tokens",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":4.0}',
            400,
            "invalid_type",
        ),
        (
            "NaN literal",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
            400,
            "invalid_json",
        ),
        ("empty messages", b'{"model":"m","messages":[]}', 400, "invalid_value"),
        ("empty body", b"", 400, "invalid_json"),
        ("json null", b"null", 400, "invalid_json"),
        ("json array", b"[]", 400, "invalid_json"),
        (
            "duplicate keys",
            b'{"model":"sim-model","model":"sim-model","messages":[{"role":"user","content":"x"}],"max_tokens":4,"max_tokens":5}',
            200,
            None,
        ),
        (
            "unknown model",
            b'{"model":"no-such-model","messages":[{"role":"user","content":"x"}],"max_tokens":4}',
            404,
            None,
        ),
        (
            "n too big",
            b'{"model":"sim-model","messages":[{"role":"user","content":"x"}],"n":1000}',
            400,
            "invalid_value",
        ),
    ],
)
def test_named_bad_input(
    client: httpx.Client, gateway: str, name: str, raw: bytes, status: int | None, code: str | None
) -> None:
    resp = client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert_answer_ok(resp)
    if status is not None:
        assert resp.status_code == status, (name, resp.text[:300])
    if code is not None:
        assert resp.json()["error"]["code"] == code, (name, resp.text[:300])
    no_reservation_left(gateway)


def test_duplicate_and_many_messages(client: httpx.Client) -> None:
    same = {"role": "user", "content": "the same words again"}
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "sim-model", "messages": [same] * 2000, "max_tokens": 4},
    )
    assert_answer_ok(resp)
    assert resp.status_code == 200


def test_multi_million_char_prompts(client: httpx.Client, gateway: str) -> None:
    # 3 M characters: under the body limit, far over any backend's KV cache: a 400 that says so.
    resp = client.post(
        "/v1/completions",
        json={"model": "sim-model", "prompt": "lorem ipsum " * 250_000, "max_tokens": 4},
    )
    assert_answer_ok(resp)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    # 6 M characters: over the 4 MiB body limit: 413 before anything is parsed.
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "sim-model", "messages": [{"role": "user", "content": "x" * 6_000_000}]},
    )
    assert_answer_ok(resp)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    no_reservation_left(gateway)


@pytest.mark.parametrize(
    ("ctype", "status"),
    [
        ("text/plain", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/json; charset=utf-8", 200),
        (None, 200),
    ],
)
def test_wrong_content_types(client: httpx.Client, ctype: str | None, status: int) -> None:
    raw = orjson.dumps(
        {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    )
    headers = {"content-type": ctype} if ctype is not None else {}
    req = client.build_request("POST", "/v1/chat/completions", content=raw, headers=headers)
    if ctype is None:
        req.headers.pop("content-type", None)
    resp = client.send(req)
    assert_answer_ok(resp)
    assert resp.status_code == status, resp.text[:200]


def test_oversized_headers_and_unknown_paths(client: httpx.Client) -> None:
    resp = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": []}, headers={"x-big": "a" * 40_000}
    )
    assert resp.status_code in (400, 431), resp.status_code
    if resp.status_code == 431:
        assert_answer_ok(resp)
    for method, path in (
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/nope"),
        ("DELETE", "/v1/completions"),
        ("GET", "/../../etc/passwd"),
    ):
        r = client.request(method, path)
        assert_answer_ok(r)
        assert r.status_code in (404, 405)


# --------------------------------------------------------------------------- schemathesis
def test_schemathesis_openapi(gateway: str) -> None:
    """Every operation of the gateway's OpenAPI document, valid and invalid data alike."""
    # A dev dependency (pyproject.toml): missing, it is an error, not a skip.
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    # The gateway serves its OpenAPI document to the admin key only (none is configured
    # here): the document comes from the same app, built locally.
    doc = create_app(gateway_cfg([{"name": "x", "url": gateway}])).openapi()
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/health",
        "/metrics",
    }
    seen: dict[int, int] = {}
    with httpx.Client(base_url=gateway, timeout=60, trust_env=False) as c:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                try:
                    _fuzz_operation(c, gateway, op, op.as_strategy(generation_mode=mode), seen)
                except Unsatisfiable:
                    assert mode == GenerationMode.NEGATIVE  # no inputs: no invalid data to make
    assert seen and max(seen) < 500, seen
    print(f"schemathesis {schemathesis.__version__}: status counts {sorted(seen.items())}")


def _fuzz_operation(
    c: httpx.Client, gateway: str, op: Any, strategy: Any, seen: dict[int, int]
) -> None:
    admin = op.path.startswith("/admin")  # no admin key is configured: every call must be refused

    @settings(
        max_examples=15,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url=gateway)
        resp = c.request(
            kwargs["method"],
            kwargs["url"],
            headers=kwargs.get("headers"),
            params=kwargs.get("params"),
            content=kwargs.get("data") or _json_bytes(kwargs),
        )
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        if admin:
            assert resp.status_code in (400, 401, 403, 404, 405, 422), (op.path, resp.status_code)
        if (
            resp.headers.get("content-type", "").startswith("application/json")
            or resp.status_code >= 400
        ):
            assert_answer_ok(resp)
        else:
            assert resp.status_code < 500

    run()


def _json_bytes(kwargs: dict[str, Any]) -> bytes | None:
    if "json" in kwargs and kwargs["json"] is not None:
        return dumps(kwargs["json"])
    return None
