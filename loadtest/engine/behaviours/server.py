"""Start and stop one simulated vLLM / SGLang / TGI server (in a test or as a process)."""

from __future__ import annotations

import asyncio

from loadtest.engine.behaviours.app import FRONT_KEY, BehaviourConfig, Front, build_app
from loadtest.engine.serving import AppServer, serve_until_stopped


class BehaviourServer(AppServer):
    """One server on ``host``; ``port=0`` picks a free port."""

    def __init__(self, config: BehaviourConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(build_app(config), host, port)
        self.config = config
        self.front.host = host

    @property
    def front(self) -> Front:
        return self.app[FRONT_KEY]


async def serve(config: BehaviourConfig, host: str, port: int) -> None:
    ready = f"kvroute engine {config.name} ({config.behaviour})"
    await serve_until_stopped(BehaviourServer(config, host, port), ready)


def run(config: BehaviourConfig, host: str, port: int) -> None:
    asyncio.run(serve(config, host, port))
