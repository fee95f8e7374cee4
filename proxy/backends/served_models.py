"""What each backend serves: its ``GET /v1/models`` read through its kind's adapter, cached.

Model lists change rarely (a restart, a LoRA adapter loaded), so they are read once per
``collector.models_refresh_s`` (default 30 s), alongside a scrape round, not every round.
A failed read keeps the last good list; configured ``models`` always win.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

import httpx

from proxy.backends.base import ModelsInfo
from proxy.backends.registry import adapter_for
from proxy.config import BackendConfig

log = logging.getLogger("kvroute.collector")

MAX_MODELS_BYTES = 1024 * 1024  # a model list is a few kB even with hundreds of LoRA adapters


@dataclass(slots=True)
class ModelsDirectory:
    """Per backend: the last good answer, when it was asked, the last error."""

    info: dict[str, ModelsInfo] = field(default_factory=dict)
    fetched_at: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def served(self, backend: BackendConfig) -> tuple[str, ...]:
        """The model ids a backend serves: its configured ``models``, else what it lists."""
        if backend.models:
            return backend.models
        got = self.info.get(backend.name)
        return got.ids if got is not None else ()

    async def refresh(
        self, client: httpx.AsyncClient, backends: list[BackendConfig], now: float, every_s: float
    ) -> None:
        """Read the lists that are due (never read, or read ``every_s`` ago or more)."""
        due = [b for b in backends if now - self.fetched_at.get(b.name, -math.inf) >= every_s]
        for b in due:
            self.fetched_at[b.name] = now
        await asyncio.gather(*(self._fetch(client, b) for b in due))

    async def _fetch(self, client: httpx.AsyncClient, backend: BackendConfig) -> None:
        path = (
            backend.models_path
            if backend.models_path.startswith("/")
            else "/" + backend.models_path
        )
        try:
            # Bounded by the client's own timeouts, and by size here.
            # The backend's own credential (api_key, or the URL's user:pass), as the gateway sends it.
            cred = backend.credential()
            headers = {"authorization": cred} if cred is not None else None
            async with client.stream("GET", backend.plain_url + path, headers=headers) as resp:
                if resp.status_code != 200:
                    raise ValueError(f"HTTP {resp.status_code} from {path}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_MODELS_BYTES:
                        raise ValueError(f"{path} body larger than {MAX_MODELS_BYTES} bytes")
            got = adapter_for(backend.kind).parse_models(bytes(body))
        except (ValueError, httpx.HTTPError) as exc:
            if self.errors.get(backend.name) != str(exc):
                log.info("collector: %s %s unreadable: %s", backend.name, path, exc)
            self.errors[backend.name] = str(exc)
            return
        self.errors.pop(backend.name, None)
        self.info[backend.name] = got
