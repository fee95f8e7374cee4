"""The ``continuation`` section: carrying a stream whose backend died over to another one.

On by default for the vLLM and SGLang kinds, whose chat API can continue a partial
assistant message (``continue_final_message``); off for the others (TGI has no such
parameter; a custom server may not). See docs/continuation.md.
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.base import BackendKind, _Strict


class ContinuationConfig(_Strict):
    enabled: bool = Field(
        default=True, description="continue a stream broken after its first byte elsewhere"
    )
    kinds: tuple[BackendKind, ...] = Field(
        default=("vllm", "sglang"),
        description="backend kinds that continue streams (both the broken and the next one)",
    )
    models: tuple[str, ...] | None = Field(
        default=None, description="only these models' streams (null: every model)"
    )
    max_continuations: int = Field(
        default=1, ge=0, le=8, description="continuations of one stream at most"
    )
    stall_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="a continuable stream silent this long after its first event is broken "
        "(null: upstream.idle_timeout_s)",
    )

    def covers(self, kind: str, model: str) -> bool:
        """Whether a stream of ``model`` on a backend of ``kind`` may be continued."""
        if not self.enabled or self.max_continuations < 1 or kind not in self.kinds:
            return False
        return self.models is None or model in self.models
