"""Running the application under uvicorn: the API-key check, a shutdown that drains the
engine loop first, the address announced once listening, and signals.

``run_server`` installs handlers for SIGINT and SIGTERM that exit with status 0: uvicorn
catches the signal itself, shuts down gracefully, then re-raises it once it is done.

The shutdown is bounded: the engine loop aborts what still runs ``shutdown_timeout``
seconds after the signal (the streams end with an error event, the other requests with a
503); uvicorn waits for the connections to close at most ``GRACE_SLACK_S`` (rounded up to
a whole second, as uvicorn counts) longer, then cancels them; the engine thread gets
``STOP_WAIT_S`` to end. So ``serve`` exits within ``shutdown_timeout + SHUTDOWN_BOUND_S``
(``serve_cli`` ends the process as soon as the server is down).
"""

from __future__ import annotations

import math
import signal
import sys
from typing import Any

import uvicorn

from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.dp_client import DPClient
from paged_engine.entrypoints.openai_server import OpenAIServer
from paged_engine.entrypoints.settings import ServerSettings

GRACE_SLACK_S = 1.0
"""Beyond ``shutdown_timeout``: time for the aborted requests' last events to go out and
their connections to close, before uvicorn cancels what is left."""
SHUTDOWN_BOUND_S = 3.0
"""After ``shutdown_timeout``, the process has exited within this: ``GRACE_SLACK_S`` plus
uvicorn's rounding up to a whole second (at most 2 s), ``STOP_WAIT_S`` (1 s) for the
engine thread, and the process's own end."""


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
        # uvicorn counts from its own shutdown's start, which is the engine loop's too
        timeout_graceful_shutdown=math.ceil(s.shutdown_timeout + GRACE_SLACK_S),
    )


def _exit_quietly(signum: int, frame: object) -> None:
    """What uvicorn re-raises after its graceful shutdown: exit with status 0."""
    raise SystemExit(0)


def run_server(llm: Any, settings: ServerSettings, model_root: str | None = None) -> int:
    """Serve ``llm`` until SIGTERM or SIGINT (see the module docstring); ``model_root`` is
    shown as the model's ``root`` in ``/v1/models``. Returns the exit status."""
    return serve(OpenAIServer.from_llm(llm, settings, model_root))


def run_core_server(
    client: CoreClient | DPClient,
    tokenizer: Any,
    settings: ServerSettings,
    model_root: str | None = None,
) -> int:
    """Serve the engine core process(es) behind ``client`` (launched: ``info`` is set).
    If every core dies with no restart left, the server shuts down and exits with 1."""
    assert client.info is not None
    cores = client.replicas if isinstance(client, DPClient) else [client]
    for core in cores:  # the text is made here, with the tokenizer the server parses with
        core.streams.use_tokenizer(tokenizer)
    server = OpenAIServer(
        client,
        settings,
        tokenizer=tokenizer,
        max_model_len=client.info.max_model_len,
        model_root=model_root,
    )
    return serve(server, cores)


def serve(server: OpenAIServer, cores: list[CoreClient] | None = None) -> int:
    """Run ``server`` under uvicorn until a signal, or the death of its last core, ends
    it (exit status 1 then)."""
    config = uvicorn_config(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_quietly)
    uv = DrainingServer(config, server)
    died: list[str] = []

    def on_death(why: str) -> None:
        if not server.loop.alive:  # with data parallelism, the others may still serve
            died.append(why)
            uv.should_exit = True

    for core in cores or []:
        core.on_death = on_death
    try:
        uv.run()
    except SystemExit as e:  # _exit_quietly, once uvicorn has shut down
        return int(e.code or 0) if not died else 1
    return 1 if died else 0
