"""Test helpers that start real things: simulated engines, redis-server, the gateway."""
