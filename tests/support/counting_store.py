"""The embedded store, counting what it is asked to reserve and release (per backend and id).

Not a fake: every call goes to the real ``InProcessStore``; the counts let a test say that
each reservation a request made was released exactly once (a release it never made, or a
second one, shows).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from proxy.state.memory import InProcessStore


class CountingStore(InProcessStore):
    def __init__(self) -> None:
        super().__init__()
        self.reserved: Counter[tuple[str, str]] = Counter()
        self.released: Counter[tuple[str, str]] = Counter()

    async def reserve(self, name: str, reservation_id: str, *args: Any, **kw: Any) -> bool:
        ok = await super().reserve(name, reservation_id, *args, **kw)
        if ok:
            self.reserved[(name, reservation_id)] += 1
        return ok

    async def release(self, name: str, reservation_id: str) -> None:
        self.released[(name, reservation_id)] += 1
        await super().release(name, reservation_id)

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        self.released[(name, reservation_id)] += 1
        await super().forget(name, reservation_id, until)

    def balanced(self) -> bool:
        """Every reservation made was released once, and nothing else was released."""
        return bool(self.reserved) and self.reserved == self.released
