"""SGLang's disaggregation protocol: what a PD router adds to a request (pure, no I/O).

SGLang's router (``sglang/srt/disaggregation/mini_lb.py``, and the Rust router's PD mode)
picks a prefill and a decode server, adds three fields to the client's request and sends the
*same* request to both at once:

* ``bootstrap_host``: the prefill server's host, from its URL (an IPv6 address in brackets);
* ``bootstrap_port``: the port of the prefill server's bootstrap endpoint
  (``--disaggregation-bootstrap-port``, 8998 by default);
* ``bootstrap_room``: a random integer in ``[0, 2**63)`` naming this transfer.

The decode server asks the prefill server's bootstrap endpoint for the room, preallocates the
KV and waits for it; the prefill server computes the prompt once the decode side has joined the
room and sends the KV. The answer the client gets is the decode server's; the prefill server's
is read and dropped. The OpenAI endpoints take the three fields as scalars (the router's
``/generate`` sends lists for a batch of prompts; kvroute serves the OpenAI endpoints only).
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

# A room is a non-negative 63-bit integer (the router draws ``randint(0, 2**63 - 1)``).
ROOM_BITS = 63
# What makes no sense for the prefill server's answer, which nobody reads.
_NOT_FOR_PREFILL = ("stream_options",)


def new_room() -> int:
    """A fresh room: 63 random bits, so two requests in flight never share one."""
    return secrets.randbits(ROOM_BITS)


def bootstrap_host(url: str) -> str:
    """The host the decode server reaches the prefill server's bootstrap endpoint on.

    Raises ValueError for a URL without a host (the config refuses those already).
    """
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    return f"[{host}]" if ":" in host else host


def bootstrap_fields(prefill_url: str, port: int, room: int) -> dict[str, Any]:
    """The three fields both servers get for one transfer."""
    return {
        "bootstrap_host": bootstrap_host(prefill_url),
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


def decode_body(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The decode server's body: the client's request as it came, plus the fields."""
    return {**body, **fields}


def prefill_body(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill server's body: the same request and fields, answered in one piece.

    SGLang's router sends the prefill server the request unchanged (a stream if the client
    asked for one) and drops what comes back; kvroute asks for no stream, so the answer it
    drops is one JSON body and a failure shows as its status. A prefill server computes the
    prompt and its first token whatever ``max_tokens`` says.
    """
    out = copy.deepcopy(dict(body))
    out.update(fields)
    out["stream"] = False
    for key in _NOT_FOR_PREFILL:
        out.pop(key, None)
    return out


def transfer_lost(decode_answer: bytes) -> bool:
    """Whether a decode server's error says the KV never came (the prefill side or the link).

    SGLang's decode server fails such a request with a 500 whose message reads "Decode
    transfer failed for request ... with exception KVTransferError(bootstrap_room=...)": the
    decode server itself is sound, and may take the next pair.
    """
    return b"KVTransferError" in decode_answer or b"Decode transfer failed" in decode_answer
