"""What may leave the gateway in logs, events and headers: URLs without secrets, safe ids.

A backend URL may carry ``user:pass@``; anything written to a log or an event goes through
``redact`` first. A client's ``X-Request-Id`` is copied into logs and answer headers, so it
is cut to a bounded length and stripped of control bytes (a newline would forge a log line).
"""

from __future__ import annotations

import re

# scheme://userinfo@ : the userinfo part is what must never be written out.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
# Printable ASCII except space: what a request id may keep (RFC 9110 field value, narrowed).
_UNSAFE_ID = re.compile(r"[^\x21-\x7e]")

REQUEST_ID_MAX = 128


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def safe_request_id(raw: str | None) -> str | None:
    """The client's request id, at most ``REQUEST_ID_MAX`` visible ASCII characters; None if nothing is left."""
    if not raw:
        return None
    cleaned = _UNSAFE_ID.sub("", raw[: REQUEST_ID_MAX * 4])[:REQUEST_ID_MAX]
    return cleaned or None
