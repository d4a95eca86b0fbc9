"""Running the application under uvicorn: the API-key check, a shutdown that drains the
engine loop first, the address announced once listening, and signals.

``run_server`` installs handlers for SIGINT and SIGTERM that exit with status 0: uvicorn
catches the signal itself, shuts down gracefully, then re-raises it once it is done.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import uvicorn

from paged_engine.entrypoints.openai_server import OpenAIServer
from paged_engine.entrypoints.settings import ServerSettings


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the engine loop to drain when shutdown starts, and
    announcing the address it listens on (the real port when asked for port 0)."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer) -> None:
        super().__init__(config)
        self.openai_server = server
        self.address: tuple[str, int] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.address = (host, port)
            shown = f"[{host}]" if ":" in host else host
            name = self.openai_server.settings.served_model_name
            print(
                f"paged_engine: serving {name!r} on http://{shown}:{port}",
                file=sys.stderr,
                flush=True,
            )

    async def shutdown(self, sockets: Any = None) -> None:
        self.openai_server.loop.begin_shutdown(self.openai_server.settings.shutdown_timeout)
        await super().shutdown(sockets=sockets)


def uvicorn_config(server: OpenAIServer) -> uvicorn.Config:
    s = server.settings
    return uvicorn.Config(
        server.app,
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(s.shutdown_timeout) + 5,
    )


def _exit_quietly(signum: int, frame: object) -> None:
    """What uvicorn re-raises after its graceful shutdown: exit with status 0."""
    raise SystemExit(0)


def run_server(llm: Any, settings: ServerSettings, model_root: str | None = None) -> None:
    """Serve ``llm`` until SIGTERM or SIGINT (see the module docstring); ``model_root`` is
    shown as the model's ``root`` in ``/v1/models``."""
    server = OpenAIServer.from_llm(llm, settings, model_root)
    config = uvicorn_config(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_quietly)
    DrainingServer(config, server).run()
