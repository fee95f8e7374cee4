"""``POST /admin/reload`` under ``kvroute serve --workers N``: every worker reloads, each reports.

The workers share one port (SO_REUSEPORT), so an admin request lands on whichever worker
the kernel picks; reloading that one alone would leave workers running different configs.
So each worker also listens on a Unix socket of its own, in a private directory (mode 0700)
that the supervisor creates and names in ``KVROUTE_WORKER_DIR``. The worker that takes the
request reloads itself, then posts the same request (same admin credentials) to every other
worker's socket with ``x-kvroute-fanout: 0`` (reload here only), and answers with each
worker's outcome. A worker that cannot be reached is reported, never skipped silently.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import httpx

#: Names the supervisor's private directory of worker sockets.
WORKER_DIR_ENV = "KVROUTE_WORKER_DIR"
#: ``0`` on a reload passed between workers: reload this worker only.
FANOUT_HEADER = "x-kvroute-fanout"
#: Headers that carry the admin credential (proxy.api.admin) and travel with the fan-out.
CREDENTIAL_HEADERS = ("authorization", "x-admin-key")
PEER_TIMEOUT_S = 30.0


def bind_worker_socket(directory: str | Path) -> socket.socket:
    """This worker's Unix socket in the supervisor's directory, named by its pid."""
    path = Path(directory) / f"worker-{os.getpid()}.sock"
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.set_inheritable(True)
    return sock


class WorkerPeers:
    """The other workers of this supervisor, found as sockets in the shared directory."""

    def __init__(self, directory: str | Path, own: str | Path) -> None:
        self.directory = Path(directory)
        self.own = Path(own)

    def sockets(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("worker-*.sock") if p != self.own)

    async def reload_others(self, headers: dict[str, str]) -> list[dict[str, Any]]:
        """Each other worker's reload outcome (or why it could not be had)."""
        sent = {**headers, FANOUT_HEADER: "0"}
        return list(await asyncio.gather(*(_reload_one(p, sent) for p in self.sockets())))


async def _reload_one(path: Path, headers: dict[str, str]) -> dict[str, Any]:
    worker = path.stem.removeprefix("worker-")
    transport = httpx.AsyncHTTPTransport(uds=str(path))
    try:
        async with httpx.AsyncClient(transport=transport, timeout=PEER_TIMEOUT_S) as client:
            r = await client.post("http://worker/admin/reload", headers=headers)
        body = r.json()
        if not isinstance(body, dict) or "result" not in body:
            raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
        return {"worker": worker, **body}
    except (httpx.HTTPError, ValueError) as exc:
        return {"worker": worker, "result": "unreachable", "error": str(exc) or type(exc).__name__}


def combined(own: dict[str, Any], others: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The answer to the admin: every worker's outcome, and a status for the worst of them.

    200 when every worker reloaded (or had nothing to change); 422 when the file is invalid
    (no worker changed); 502 when a worker could not be reached or refused the request.
    """
    workers = [{"worker": str(os.getpid()), **own}, *others]
    results = {w["result"] for w in workers}
    if results <= {"ok", "unchanged"}:
        status = 200
    elif results <= {"ok", "unchanged", "invalid"}:
        status = 422
    else:
        status = 502
    result = own["result"] if len(results) == 1 else "mixed"
    return {"result": result, "workers": workers}, status


def credentials(headers: Any) -> dict[str, str]:
    """The admin credential headers of a request, to pass on to the other workers."""
    return {h: headers[h] for h in CREDENTIAL_HEADERS if h in headers}
