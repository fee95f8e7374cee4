"""Mid-stream faults of the simulated vLLM / SGLang / TGI servers, and a journal of streams.

A real engine that crashes, restarts or wedges does it in the middle of answers: the long
ones are the likeliest to be cut. So the fault strikes a stream after ``after_tokens``
tokens were written, in one of three ways a gateway sees in production:

* ``die``: the connection is reset mid-body (a crash, an OOM kill, a pod deleted);
* ``stall``: nothing more is sent, the connection stays open (a wedged engine);
* ``error``: an SSE error event, then ``[DONE]``, as vLLM's OpenAI server sends when its
  engine fails while streaming (``{"error": {"message", "type", "param", "code"}}``).

``count`` bounds how many streams it strikes (None: every stream from now on). The journal
keeps, per recent stream, the body the server got and the text it sent, so a black-box
test can check a gateway's continuation against what each server really produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson

MidStreamMode = Literal["die", "stall", "error"]
MODES: tuple[str, ...] = get_args(MidStreamMode)
JOURNAL_LEN = 64


class FaultRequestError(ValueError):
    """A fault request the admin endpoint refuses (the message names the field)."""


@dataclass(slots=True)
class MidStreamFault:
    """Strike the next ``count`` streams (None: all) after ``after_tokens`` tokens."""

    mode: MidStreamMode
    after_tokens: int
    count: int | None = None

    def take(self) -> MidStreamFault | None:
        """This fault for one more stream, or None once its count is spent."""
        if self.count is not None:
            if self.count <= 0:
                return None
            self.count -= 1
        return self


def parse_fault(data: Any) -> MidStreamFault | None:
    """The admin body ``{"mode": "die"|"stall"|"error"|"none", "after_tokens": N, "count": K}``."""
    if not isinstance(data, dict):
        raise FaultRequestError("the body must be a JSON object")
    mode = data.get("mode")
    if mode == "none":
        return None
    if mode not in MODES:
        raise FaultRequestError(f"mode must be one of {[*MODES, 'none']}, got {mode!r}")
    after = data.get("after_tokens", 1)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise FaultRequestError(f"after_tokens must be an integer >= 0, got {after!r}")
    count = data.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise FaultRequestError(f"count must be a positive integer or null, got {count!r}")
    return MidStreamFault(mode, after, count)


def error_event(message: str) -> bytes:
    """vLLM's mid-stream error event (its ``ErrorResponse`` as one SSE ``data`` line)."""
    body = {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


@dataclass(slots=True)
class StreamRecord:
    """One stream as the server saw it: the body it got, the text it sent, how it ended."""

    body: dict[str, Any]
    text: list[str] = field(default_factory=list)
    end: str = "running"

    def as_json(self) -> dict[str, Any]:
        return {"body": self.body, "text": "".join(self.text), "end": self.end}


class StreamJournal:
    """The last ``JOURNAL_LEN`` streams (bounded: a long benchmark run must not grow it)."""

    def __init__(self) -> None:
        self.records: deque[StreamRecord] = deque(maxlen=JOURNAL_LEN)

    def open(self, body: dict[str, Any]) -> StreamRecord:
        record = StreamRecord(body)
        self.records.append(record)
        return record

    def as_json(self) -> list[dict[str, Any]]:
        return [r.as_json() for r in self.records]
