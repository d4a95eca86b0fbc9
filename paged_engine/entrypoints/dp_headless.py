"""``serve MODEL --headless`` (vLLM's flag): engine cores only, no API server, serving as
the remote replicas of a head on another host (``dp_remote``).

This process spawns ``--data-parallel-size-local`` cores, as the head spawns its local
ones. Each connects to the head at ``--data-parallel-address``:``--data-parallel-rpc-port``
with the shared key (``$PAGED_ENGINE_DP_AUTHKEY``), retrying while nothing listens there
(the head may start later) until ``--data-parallel-connect-timeout``, then runs
``core_main`` over that connection: the very protocol a spawned core speaks over its
pipe. A core whose key the head refuses exits with ``EXIT_REFUSED`` before loading
anything.

Lifetime: a core ends when its connection closes (the head stopped it, died, or dropped
it), so a head that is gone leaves no core behind. This process waits for its cores and
exits once they have all ended; SIGTERM or SIGINT terminates them first.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from paged_engine.entrypoints.core_process import CoreSpec, core_main
from paged_engine.entrypoints.settings import DP_AUTHKEY_ENV, dp_authkey

RETRY_S = 0.2
"""Between two attempts to reach a head that does not listen yet."""
EXIT_REFUSED = 3
"""A core's exit status when the head refused its key."""


def connect_to_head(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """A connection to the head, authenticated both ways. Retried while the head does not
    listen (refused, reset, unreachable); ``AuthenticationError`` at once for a wrong key;
    TimeoutError past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=authkey)
        except (OSError, EOFError) as err:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no head listening at {address[0]}:{address[1]} after {timeout:g} s "
                    f"(--data-parallel-connect-timeout): {err!r}"
                ) from None
            time.sleep(RETRY_S)


def headless_core(spec: CoreSpec, address: tuple[str, int], authkey: bytes, timeout: float) -> None:
    """A headless core process's entry point: reach the head, then serve it as a spawned
    core serves its API process (``core_main``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as core_main: SIGTERM from the parent ends it
    try:
        conn = connect_to_head(address, authkey, timeout)
    except AuthenticationError:
        print(
            f"paged_engine: the head at {address[0]}:{address[1]} refused this core's key "
            f"(${DP_AUTHKEY_ENV} differs from the head's)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_REFUSED)
    except TimeoutError as err:
        print(f"paged_engine: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    core_main(spec, conn)  # ends the process itself once it has served
    sys.exit(1)  # it returned: the model was refused (the head was told why)


def run_headless(spec: CoreSpec, count: int, address: tuple[str, int], timeout: float) -> int:
    """Run ``count`` cores for the head at ``address`` until they have all ended. Exit
    status: 0 when each ended cleanly (or a signal here ended them), else 1."""
    authkey = dp_authkey()
    ctx = multiprocessing.get_context("spawn")
    cores = [
        ctx.Process(
            target=headless_core,
            args=(spec, address, authkey, timeout),
            name=f"engine-core-{i}",
            daemon=False,
        )
        for i in range(count)
    ]
    signalled: list[int] = []

    def end(signum: int, frame: object) -> None:
        signalled.append(signum)
        for core in cores:
            if core.is_alive():
                core.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, end)
    for core in cores:
        core.start()
    if signalled:  # a signal before the last start: that core was not running yet
        end(signalled[0], None)
    print(
        f"paged_engine: {count} headless engine core(s) for the head at {address[0]}:{address[1]}",
        file=sys.stderr,
        flush=True,
    )
    for core in cores:
        core.join()
    if signalled:
        return 0
    codes = [core.exitcode for core in cores]
    if any(codes):
        print(f"paged_engine: the headless cores exited with {codes}", file=sys.stderr)
    return 1 if any(codes) else 0
