"""``auth.forward_client_authorization``: what a client's Authorization header becomes upstream.

Real gateway (uvicorn in a thread), real openai client, a real backend that records the
headers it received (tests/support/recording_backend.py).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.config import ConfigError, parse_config
from tests.support.gateway import gateway_cfg, run_gateway
from tests.support.recording_backend import RecordingBackend, recording_backend

__all__ = ["recording_backend"]

CLIENT_KEY = "client-token"


def _cfg(url: str, mode: str | None, backend_key: bool = False, **sections: Any) -> Any:
    backend: dict[str, Any] = {"name": "b0", "url": url, "kind": "contiguous"}
    if backend_key:
        backend["api_key"] = "backend-secret"
    if mode is not None:
        sections.setdefault("auth", {})["forward_client_authorization"] = mode
    return gateway_cfg(
        [backend],
        routing={"policy": "round_robin", "unknown_model": "pass_through"},
        health={"active": {"enabled": False}},
        **sections,
    )


def _seen_upstream(backend: RecordingBackend, cfg: Any) -> str | None:
    """The Authorization the backend got for one openai-client request with the client's key."""
    with run_gateway(cfg, run_collector=False) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
    assert reply.choices[0].message.content == "hi"
    return backend.last().get("authorization")


def test_by_default_the_clients_authorization_never_reaches_a_backend(
    recording_backend: RecordingBackend,
) -> None:
    # Before the setting existed, the client's token went upstream whenever auth.api_keys was unset.
    assert _seen_upstream(recording_backend, _cfg(recording_backend.url, None)) is None


def test_by_default_a_backend_gets_only_its_own_key(recording_backend: RecordingBackend) -> None:
    cfg = _cfg(recording_backend.url, None, backend_key=True)
    assert _seen_upstream(recording_backend, cfg) == "Bearer backend-secret"


@pytest.mark.parametrize(
    ("mode", "backend_key", "expected"),
    [
        ("when_no_backend_key", False, f"Bearer {CLIENT_KEY}"),
        ("when_no_backend_key", True, "Bearer backend-secret"),
        ("always", False, f"Bearer {CLIENT_KEY}"),
        ("always", True, f"Bearer {CLIENT_KEY}"),
        ("never", True, "Bearer backend-secret"),
    ],
)
def test_each_setting_sends_what_it_says(
    recording_backend: RecordingBackend, mode: str, backend_key: bool, expected: str
) -> None:
    cfg = _cfg(recording_backend.url, mode, backend_key=backend_key)
    assert _seen_upstream(recording_backend, cfg) == expected


def test_a_gateway_key_can_never_be_forwarded() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "backends": [{"name": "b0", "url": "http://127.0.0.1:1", "kind": "contiguous"}],
                "auth": {"api_keys": ["k1"], "forward_client_authorization": "always"},
            },
            "kvroute.yaml",
            environ={},
        )
    assert "auth.forward_client_authorization" in str(err.value)
    assert "'always'" in str(err.value)


def test_an_unknown_setting_names_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "backends": [{"name": "b0", "url": "http://127.0.0.1:1", "kind": "contiguous"}],
                "auth": {"forward_client_authorization": "sometimes"},
            },
            "kvroute.yaml",
            environ={},
        )
    assert "forward_client_authorization" in str(err.value) and "sometimes" in str(err.value)
