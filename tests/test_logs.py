"""JSON logs carry the request id as a field and never the Authorization header."""

from __future__ import annotations

import logging

import orjson

from proxy.api.logs import JsonFormatter


def test_json_log_line_has_request_id_field() -> None:
    rec = logging.LogRecord(
        "kvroute.gateway", logging.INFO, __file__, 1, "request %s diverted", ("r1",), None
    )
    rec.request_id = "r1"
    rec.backend = "node-a"
    line = orjson.loads(JsonFormatter().format(rec))
    assert line["msg"] == "request r1 diverted"
    assert line["request_id"] == "r1" and line["backend"] == "node-a" and line["level"] == "info"
