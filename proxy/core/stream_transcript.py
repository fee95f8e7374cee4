"""What the client has received of a streamed answer, read event by event as it is relayed.

A stream can only be continued elsewhere if the gateway knows exactly what the client saw:
the text so far, roughly how many tokens it was, the chunk identity (id, created, model)
the rest must carry, and whether anything in it cannot be carried over (a tool call half
written, reasoning, log-probabilities). So while a continuable stream is relayed, only whole
SSE events pass (``feed`` holds back a partial event: if the backend dies mid-event the
client never sees half of one), and each is read here once.

An upstream error event (vLLM sends one when its engine fails mid-stream) is a break like a
reset: it and everything after it is withheld, so a continuation can take its place; when
none can, ``withheld`` is what the client gets, as it would have without continuation.

Pure logic, no I/O: the gateway's relay and tests share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from proxy.core.validation import Endpoint

_SEPARATORS = (b"\n\n", b"\r\n\r\n")
Rewrite = Callable[[bytes], bytes | None]


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each with its blank line) and the incomplete rest of ``buffer``."""
    events: list[bytes] = []
    start = 0
    while True:
        ends = [(i, len(s)) for s in _SEPARATORS if (i := buffer.find(s, start)) >= 0]
        if not ends:
            return events, buffer[start:]
        at, size = min(ends)
        events.append(buffer[start : at + size])
        start = at + size


def event_data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (lines joined by newlines); None when it has none."""
    lines = [ln.rstrip(b"\r") for ln in event.split(b"\n")]
    data = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
    return b"\n".join(data) if data else None


def is_error_event(obj: Any) -> str | None:
    """The message of an error event (``{"error": ...}`` or vLLM's older ``{"object": "error"}``)."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message", "error"))
    if err is not None:
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message", "error"))
    return None


class Transcript:
    """One stream as the client received it (only whole events are relayed)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._pending = b""
        self.parts: list[str] = []
        # Events that carried text: a floor on the tokens sent (one token per event or more).
        self.text_events = 0
        self.identity: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.done = False
        # Why this stream cannot be continued (None: it can); set by what passed through.
        self.blocker: str | None = None
        # An upstream error event: the stream broke; its bytes (and the rest) withheld.
        self.error: str | None = None
        self.withheld = b""
        self.usage: dict[str, Any] | None = None

    def next_part(self) -> None:
        """A continuation's events follow: the last part's break and leftovers are history."""
        self._pending = b""
        self.error = None
        self.withheld = b""
        self.done = False

    def final_error_event(self) -> bytes:
        """The withheld error event as the client gets it when nothing continues: with ``[DONE]``."""
        if b"[DONE]" in self.withheld:
            return self.withheld
        return self.withheld.rstrip(b"\r\n") + b"\n\ndata: [DONE]\n\n"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def complete(self) -> bool:
        """The answer ended properly: a finish reason was sent (the rest is bookkeeping)."""
        return self.finish_reason is not None

    def feed(self, data: bytes, rewrite: Rewrite | None = None) -> bytes:
        """The whole events in ``data`` (with what was held back) that may go to the client now.

        ``rewrite``: applied to each whole event first (a continuation's events become the
        first stream's: ``proxy.core.continuation.Splice``); None from it drops the event.
        """
        if self.error is not None:
            self.withheld += data
            return b""
        if rewrite is None and not self._pending and _plain(data):
            # The usual chunk: whole ``data:`` events, nothing held back. Relayed as it came.
            pieces = data.split(b"\n\n")
            for i in range(len(pieces) - 1):
                if not self._read_data(pieces[i][6:]):
                    # The error event and what follows are withheld.
                    cut = sum(len(p) + 2 for p in pieces[:i])
                    self.withheld = data[cut:]
                    return data[:cut]
            return data
        return self._feed_events(data, rewrite)

    def _feed_events(self, data: bytes, rewrite: Rewrite | None) -> bytes:
        events, self._pending = split_events(self._pending + data)
        out: list[bytes] = []
        for i, raw in enumerate(events):
            event = rewrite(raw) if rewrite is not None else raw
            if event is None:
                continue
            if not self._read(event):
                self.withheld = b"".join(events[i:]) + self._pending
                self._pending = b""
                break
            out.append(event)
        return b"".join(out)

    def _read(self, event: bytes) -> bool:
        """Take one event into account; False for an error event (withheld from then on)."""
        data = event_data(event)
        return True if data is None else self._read_data(data)

    def _read_data(self, data: bytes) -> bool:
        """One event's ``data``; False for an error event."""
        if data.startswith(b"[DONE]") or data.strip() == b"[DONE]":
            self.done = True
            return True
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.blocker = self.blocker or "unreadable_event"
            return True
        message = is_error_event(obj)
        if message is not None:
            self.error = message
            return False
        if isinstance(obj, dict):
            self._read_chunk(obj)
        return True

    def _read_chunk(self, obj: dict[str, Any]) -> None:
        if not self.identity:
            self.identity = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict):
                self._read_choice(choice)

    def _read_choice(self, choice: dict[str, Any]) -> None:
        if choice.get("index", 0) != 0:
            self.blocker = "several_choices"
        if choice.get("logprobs") is not None:
            self.blocker = "logprobs"
        if self.endpoint == "chat":
            delta = choice.get("delta") or {}
            # Usually {"content": ...} alone: the other keys are looked at only when present.
            if len(delta) > 1 or "content" not in delta:
                self._read_delta_extras(delta)
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.parts.append(text)
            self.text_events += 1
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])

    def _read_delta_extras(self, delta: dict[str, Any]) -> None:
        if delta.get("tool_calls") or delta.get("function_call"):
            self.blocker = "tool_call"
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self.blocker = "reasoning"


def _plain(data: bytes) -> bool:
    """Whole one-line ``data: `` events only, ``\\n\\n``-separated (vLLM's and SGLang's way)."""
    return (
        data.startswith(b"data: ")
        and data.endswith(b"\n\n")
        and b"\r" not in data
        and data.count(b"\n") == 2 * data.count(b"\n\n")
        and data.count(b"data: ") == data.count(b"\n\n")
    )
