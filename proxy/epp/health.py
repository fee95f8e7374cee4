"""The gRPC Health Checking Protocol on its own port, as the reference EPP serves it.

Kubernetes' gRPC probes ask for a service by name: ``liveness`` (the process answers),
``readiness`` (the gateway started and the ext_proc server listens) and the ext_proc
service's own name; the empty name means the whole server. A pod that drains says
NOT_SERVING first, so no new stream is sent to it while its streams finish.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
_READY_NAMES = (READINESS, EXT_PROC_SERVICE, "")


def servicer() -> health.aio.HealthServicer:
    """Alive from the start; not ready until ``ready(...)`` says so."""
    return health.aio.HealthServicer()


async def alive(s: health.aio.HealthServicer) -> None:
    await s.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)


async def ready(s: health.aio.HealthServicer, serving: bool) -> None:
    """Readiness (and the ext_proc service, and the server as a whole) up or down."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in _READY_NAMES:
        await s.set(name, status)
