"""Shared fixtures: real redis-server and real simulated engines (see tests/support/)."""

pytest_plugins = ["tests.support.redis_server", "tests.support.engines"]
