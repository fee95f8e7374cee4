"""Simulated engines that behave like vLLM, SGLang or TGI (``kvroute engine --behaviour``).

``kvroute`` (the default) is ``loadtest.engine.server``: allocation at admission, 503 on
failure, the kvroute gauges. The modes here are paged and lazily allocating, queue instead of
failing, preempt and recompute (vLLM, SGLang), and export each server's own metric names.
"""

from __future__ import annotations

from loadtest.engine.behaviours.app import BehaviourConfig, Front, build_app
from loadtest.engine.behaviours.server import BehaviourServer, run

BEHAVIOURS = ("kvroute", "vllm", "sglang", "tgi")

__all__ = ["BEHAVIOURS", "BehaviourConfig", "BehaviourServer", "Front", "build_app", "run"]
