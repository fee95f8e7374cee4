"""What every backend adapter gives the gateway, whatever server it reads.

An adapter is three pure functions over one server kind's own formats (no I/O, no clock):

* ``parse_metrics``: ``/metrics`` text -> ``MemoryReport`` (capacity, free, the largest
  request that fits now, queue and preemption figures);
* ``parse_models``: the ``GET /v1/models`` body -> served model ids and each one's
  ``max_model_len`` (the per-request limit the server enforces with its own 400);
* ``classify_error``: an error answer (status + body) -> what it means for routing:
  ``allocation`` (this node cannot hold the request now: divert), ``overload`` (busy: divert,
  no ceiling learned), ``client_error`` (the request itself is bad: relay as is),
  ``server_error`` (anything else from the server).

The collector picks the adapter by the backend's configured ``kind``
(``proxy.backends.registry.adapter_for``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import orjson

from proxy.config.base import KvLayout
from proxy.core.fleet import MemoryReport

ErrorClass = Literal["allocation", "overload", "client_error", "server_error"]
"""The same words as ``proxy.upstream.classify.Verdict`` (less "ok"), so the gateway can use either."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class ModelsInfo:
    """What ``GET /v1/models`` said: the ids a backend serves and their context limits."""

    models: tuple[ServedModel, ...] = ()

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.models)

    def max_model_len(self, model: str | None = None) -> int | None:
        """The limit for ``model`` (or the smallest over all models when ``None`` or unknown)."""
        for m in self.models:
            if m.id == model:
                return m.max_model_len
        known = [m.max_model_len for m in self.models if m.max_model_len]
        return min(known) if known else None


class Adapter(Protocol):
    """One server kind's formats, read into kvroute's terms."""

    kind: str

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport: ...

    def parse_models(self, body: bytes) -> ModelsInfo: ...

    def classify_error(self, status: int, body: bytes) -> ErrorClass: ...


@runtime_checkable
class PagesAdapter(Adapter, Protocol):
    """A kind whose state takes more than ``/metrics``: the scrape also reads ``pages``."""

    pages: tuple[str, ...]

    def parse_pages(
        self,
        text: str,
        pages: Mapping[str, bytes],
        layout: KvLayout,
        now: float,
        capacity_override: int | None = None,
    ) -> MemoryReport: ...


# --- shared readers ---------------------------------------------------------------------------


def parse_openai_models(body: bytes) -> ModelsInfo:
    """The OpenAI list shape ``{"data": [{"id": ..., "max_model_len": ...}]}``.

    vLLM and SGLang add ``max_model_len`` to each entry; a server that does not (TGI, the
    OpenAI API) gives ids only. Raises ``ValueError`` for a body that is not that shape.
    """
    return ModelsInfo(
        tuple(
            ServedModel(entry["id"], positive_int(entry.get("max_model_len")))
            for entry in model_entries(body)
        )
    )


def model_entries(body: bytes) -> list[dict[str, Any]]:
    """The entries of an OpenAI ``/v1/models`` list that have a string ``id`` (the others
    are skipped). Raises ``ValueError`` for a body that is not that shape."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"/v1/models is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models has no 'data' list")
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


def positive_int(value: object) -> int | None:
    """``value`` if it is a positive integer (not a bool), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok and isinstance(value, int) else None


def error_fields(body: bytes) -> tuple[str, str, str]:
    """(message, type, code) from any of the error shapes the servers use, lower-cased.

    Nested OpenAI ``{"error": {"message", "type", "code"}}`` (current vLLM, kvroute);
    flat ``{"object": "error", "message", "type", "code"}`` (SGLang, older vLLM);
    TGI's ``{"error": "...", "error_type": "..."}``. Unknown shapes give empty strings.
    """
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace").lower(), "", ""
    if not isinstance(doc, dict):
        return "", "", ""
    err = doc.get("error")
    if isinstance(err, dict):
        doc = err
    elif isinstance(err, str):
        return err.lower(), str(doc.get("error_type") or "").lower(), ""
    return (
        str(doc.get("message") or "").lower(),
        str(doc.get("type") or "").lower(),
        str(doc.get("code") or "").lower(),
    )


# Each word on word boundaries, except "outofmemory" (``torch.OutOfMemoryError``): as a bare
# substring "oom" is also in "room" (SGLang's "bootstrap_room") and "zoom".
_OOM_TEXT = re.compile(r"outofmemory|\b(?:out of memory|oom|kv cache|no free blocks)\b")


def says_out_of_memory(message: str) -> bool:
    """A lower-cased error message that reports running out of (KV) memory."""
    return _OOM_TEXT.search(message) is not None


def generic_class(status: int) -> ErrorClass:
    """The status alone: 429/503 busy, 4xx the client's, the rest the server's."""
    if status in (429, 503):
        return "overload"
    if 400 <= status < 500:
        return "client_error"
    return "server_error"
