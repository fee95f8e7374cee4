"""What every config section shares: strict models and the closed sets of names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError

BackendKind = Literal["vllm", "sglang", "tgi", "llamacpp", "contiguous", "paged"]
# How a llama.cpp server's slots share its KV cache (proxy.backends.llamacpp).
KvLayout = Literal["unified", "partitioned"]
PoolRole = Literal["general", "long"]
# Disaggregated serving (docs/disaggregation.md): which step of a request a backend takes.
ServingRole = Literal["prefill", "decode", "both"]
PolicyName = Literal["kvroute", "round_robin", "least_loaded", "most_free"]


class _Strict(BaseModel):
    """Base: unknown keys are errors, so a typo in a config file is never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
