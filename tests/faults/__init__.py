"""Fault injection against real processes (see docs/reliability.md)."""
