"""kvroute as the endpoint picker (EPP) of Kubernetes inference gateways.

Envoy's ext_proc protocol, as the Gateway API Inference Extension uses it: the gateway
streams each request to the EPP, which names the endpoint in ``x-gateway-destination-endpoint``.
This package only speaks that protocol. Every decision (sizing, fit, reservations, pools,
affinity, memory pressure) is the gateway's own walk (``proxy.gateway``), reached through
``proxy.epp.door``: the EPP is one more door into it, not a second router.

    messages   protobuf answers: header mutation, streamed body chunks, immediate responses
    endpoints  backend name <-> ``ip:port``, the subset hint
    guard      the gateway's request guard (headers, key, body, concurrency) on each stream
    door       one request into the walk: place and reserve, or the gateway's refusal
    bodiless   requests without a body: the model list, or a backend in turn
    learn      what the answer teaches (status, usage from JSON or SSE), release once
    failures   an error answer read as the gateway reads it (allocation, overload, 5xx)
    exchange   one ext_proc stream, message by message
    health     the gRPC health service (liveness, readiness, the ext_proc service)
    server     the grpc.aio servers, started next to the gateway app
    main       ``kvroute epp``
"""
