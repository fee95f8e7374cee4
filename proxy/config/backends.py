"""Backends: each server the gateway routes to, pools, and discovery of a changing list."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import Annotated, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import Field, HttpUrl, model_validator

from proxy.config.base import BackendKind, KvLayout, PoolRole, ServingRole, _Strict
from proxy.config.kv_events import KvEventsEndpoint

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError

# SGLang's ``--disaggregation-bootstrap-port`` default (``ServerArgs.disaggregation_bootstrap_port``).
SGLANG_BOOTSTRAP_PORT = 8998


class BackendConfig(_Strict):
    """One inference server behind the gateway."""

    # No leading "-": a name is passed to restart hooks' argv, where it must not read as an option.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:][A-Za-z0-9_.:-]*$")
    url: HttpUrl
    pool: str = "general"
    kind: BackendKind = "vllm"
    capacity_tokens: int | None = Field(
        default=None, gt=0, description="override the reported KV capacity"
    )
    role: ServingRole = Field(
        default="both",
        description="disaggregated serving: prefill (step 1 only, never ordinary requests), "
        "decode (step 2 and ordinary requests) or both",
    )
    metrics_path: str = "/metrics"
    api_key: str | None = Field(
        default=None,
        min_length=1,
        description="sent upstream as 'Authorization: Bearer KEY' instead of the client's",
    )
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding api_key (read when the gateway starts)",
    )
    models: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        default=(),
        description="model ids served here; empty: discovered from the backend's /v1/models",
    )
    models_path: str = "/v1/models"
    prefill_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="queueing backends: prompt tokens prefilled per second (expected wait); "
        "none: 10000 per engine",
    )
    decode_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="queueing backends: output tokens per second per request; none: 30",
    )
    max_num_seqs: int | None = Field(
        default=None,
        gt=0,
        description="queueing backends: requests running at once, all engines together (vLLM "
        "--max-num-seqs x data-parallel size); none: learned from the server's queue",
    )
    data_parallel_routing: Literal["gateway", "server"] = Field(
        default="gateway",
        description="a server with several data-parallel engines behind its URL: gateway "
        "(pick the engine by projected KV room and pin it with the X-data-parallel-rank "
        "header, which vLLM and SGLang honour) or server (its front end picks by queue length)",
    )
    kv_layout: KvLayout = Field(
        default="unified",
        description="kind llamacpp: how the slots share the KV cache: unified (one pool; "
        "--kv-unified, and llama-server's default with -np auto) or partitioned (-np N without "
        "--kv-unified: each slot n_ctx/N of its own); no page of the server shows which",
    )
    kv_events: KvEventsEndpoint | None = Field(
        default=None, description="where the server publishes KV-cache events (docs/kv-events.md)"
    )
    bootstrap_port: int = Field(
        default=SGLANG_BOOTSTRAP_PORT,
        ge=1,
        le=65535,
        description="SGLang prefill servers (disaggregation.protocol: sglang): the port of the "
        "server's bootstrap endpoint (--disaggregation-bootstrap-port; SGLang's default 8998)",
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> BackendConfig:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        return self

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def plain_url(self) -> str:
        """The URL without ``user:pass@``: the gateway sends those as a header (``credential``)."""
        parts = urlsplit(str(self.url))
        netloc = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")

    def credential(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The Authorization value sent upstream: api_key(_env) as Bearer, else the URL's user:pass."""
        key = self.api_key
        if key is None and self.api_key_env is not None:
            key = (os.environ if environ is None else environ).get(self.api_key_env) or None
        if key is not None:
            return f"Bearer {key}"
        if self.url.username is not None:
            user = unquote(self.url.username)
            password = unquote(self.url.password or "")
            return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return None


class PoolConfig(_Strict):
    """A named group of backends; ``role: long`` marks the dedicated long-request pool."""

    role: PoolRole = "general"


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubernetesApiConfig(_Strict):
    """How to reach the Kubernetes API: the in-cluster defaults, overridable (tests, kubectl proxy)."""

    api_url: str = "https://kubernetes.default.svc"
    token_path: str | None = f"{SERVICE_ACCOUNT_DIR}/token"
    ca_path: str | None = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
    namespace: str | None = Field(
        default=None, description="absent: the gateway pod's own namespace"
    )


class DiscoveryConfig(KubernetesApiConfig):
    """Where the backend list comes from: ``static`` (``backends``), ``kubernetes``
    (EndpointSlices), ``inferencepool`` (an InferencePool's pods), ``dns``."""

    type: Literal["static", "kubernetes", "inferencepool", "dns"] = "static"
    label_selector: str = Field(
        default="", description="kubernetes: selects the inference Services' EndpointSlices"
    )
    port: int | str | None = Field(
        default=None, description="kubernetes: port number or name (absent: the slice's first port)"
    )
    pool_label: str = Field(
        default="kvroute.io/pool", description="kubernetes: the slice label naming the pool"
    )
    pool: str = Field(default="general", description="the pool when no pool label says otherwise")
    role_label: str = Field(
        default="kvroute.io/role",
        description="kubernetes: the slice label naming the serving role (prefill, decode, both)",
    )
    kind: BackendKind = "vllm"
    name: str | None = Field(default=None, description="dns: the name to resolve (A or SRV)")
    inference_pool: str | None = Field(
        default=None,
        description="inferencepool: the InferencePool (inference.networking.k8s.io/v1) whose "
        "pods are the backends, in discovery.namespace",
    )
    interval_s: float = Field(
        default=10.0, gt=0, description="dns: re-resolve period; kubernetes: watch timeout"
    )
    capacity_tokens: int | None = Field(default=None, gt=0)
    data_parallel_routing: Literal["gateway", "server"] = Field(
        default="gateway", description="every discovered backend's (see backends[])"
    )
    kv_events: KvEventsEndpoint | None = Field(
        default=None, description="every discovered backend's KV-event ports (docs/kv-events.md)"
    )

    @model_validator(mode="after")
    def _complete(self) -> DiscoveryConfig:
        if self.type == "inferencepool" and not self.inference_pool:
            raise ValueError(
                "discovery.inference_pool is required when discovery.type is 'inferencepool'"
            )
        if self.type == "dns" and not self.name:
            raise ValueError("discovery.name is required when discovery.type is 'dns'")
        if self.type == "dns" and self.port is not None and not isinstance(self.port, int):
            raise ValueError("discovery.port must be a number for dns (or absent with SRV)")
        return self
