"""What every restart hook is: ``restart(name, url)`` that never raises, and its result.

Apart from the hooks themselves so that ``restart_hooks`` (which builds any of them, the
Kubernetes one included) and ``restart_kubernetes`` (one of them) form no import circle.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HookResult:
    ok: bool
    # For the log only: may hold a command's output or an HTTP hook's target and body.
    detail: str
    duration_s: float = 0.0
    # For the open event log: what happened, without output or URLs ("" = the detail is safe).
    summary: str = ""
    # The backend that replaces the restarted one, when it comes back under another name.
    replaced_by: str | None = None

    @property
    def public(self) -> str:
        return self.summary or self.detail


class RestartHook(abc.ABC):
    kind: str = "abstract"

    @abc.abstractmethod
    async def restart(self, name: str, url: str) -> HookResult:
        """Restart backend ``name`` (base URL ``url``); never raises."""

    async def close(self) -> None:
        return None
