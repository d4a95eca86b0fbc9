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
it), or when TCP keepalive finds the head's host gone (``KEEPALIVE_IDLE_S``), so a head
that is gone leaves no core behind. On CUDA each core sees only its own devices
(``replica_devices``). This process waits for its cores and
exits once they have all ended; SIGTERM or SIGINT terminates them first.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from paged_engine.cpu_bind import replica_spec
from paged_engine.entrypoints.core_process import CoreSpec, core_main
from paged_engine.entrypoints.settings import DP_AUTHKEY_ENV, dp_authkey

RETRY_S = 0.2
"""Between two attempts to reach a head that does not listen yet."""
EXIT_REFUSED = 3
"""A core's exit status when the head refused its key."""
AUTH_TIMEOUT_S = 10.0
"""The most one side waits for the other's part of the key's handshake. Why a bound: a
peer that connects and says nothing would hold the handshake's read forever (the head's
listener, once, held every real core off that way until the connect timeout)."""
KEEPALIVE_IDLE_S = 5
"""TCP keepalive, on both ends of a head-headless connection: the seconds of silence
before the first probe. Why: a peer whose host vanishes (power, network) sends no FIN,
so without probes a blocked ``recv`` would wait forever and its replica would never be
counted dead; with them the kernel ends the connection and ``recv`` raises OSError, which
the head (and the core) already take as the other side's end."""
KEEPALIVE_INTERVAL_S = 2
"""Between two unanswered keepalive probes."""
KEEPALIVE_COUNT = 5
"""Unanswered probes before the connection is dropped: a dead peer is detected within
``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT`` (15 s) of silence. The same
bound applies as ``TCP_USER_TIMEOUT`` to data sent and not acknowledged (probes are not
sent while some is outstanding: a request sent to a vanished host would wait minutes for
the retransmissions to give up)."""
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
_ENV_LOCK = threading.Lock()


def keep_alive(sock: socket.socket) -> None:
    """Probe ``sock``'s peer as the ``KEEPALIVE_*`` constants say (each option where this
    platform has it)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    dead_ms = 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", dead_ms),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def shut_down(conn: Connection) -> None:
    """End ``conn`` both ways: a thread blocked reading it wakes (a bare ``close`` would
    not wake it) and the peer sees it end."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=conn.fileno())
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()


def authenticated(
    sock: socket.socket, authkey: bytes, *, server: bool, timeout: float | None = None
) -> Connection:
    """``sock`` as a connection, kept alive, once each side has proved it knows the key
    (``multiprocessing.connection``'s HMAC challenge, both ways, the server's first, as
    ``Listener``/``Client`` do). ``AuthenticationError`` for a wrong key; TimeoutError
    when the handshake takes past ``timeout`` (``AUTH_TIMEOUT_S``; the socket is shut down
    then: the read it waits in ends). The socket is closed on any failure."""
    timeout = AUTH_TIMEOUT_S if timeout is None else timeout
    try:
        keep_alive(sock)
        sock.setblocking(True)
    except OSError:
        sock.close()
        raise
    conn = Connection(sock.detach())
    gate = threading.Lock()
    late: list[bool] = []  # [True] once the deadline passed, [False] once done in time

    def expire() -> None:
        with gate:
            if not late:
                late.append(True)
                shut_down(conn)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        first, second = (deliver_challenge, answer_challenge)
        if not server:
            first, second = second, first
        first(conn, authkey)
        second(conn, authkey)
    except BaseException:
        timer.cancel()
        conn.close()
        if late:
            raise TimeoutError(f"no key handshake within {timeout:g} s") from None
        raise
    timer.cancel()
    with gate:
        late.append(False)
    if late[0]:
        conn.close()
        raise TimeoutError(f"no key handshake within {timeout:g} s")
    return conn


def connect_to_head(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """A connection to the head, authenticated both ways, kept alive. Retried while the
    head does not listen or answer (refused, reset, unreachable, silent);
    ``AuthenticationError`` at once for a wrong key; TimeoutError past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(address, timeout=AUTH_TIMEOUT_S)
            return authenticated(sock, authkey, server=False)
        except (OSError, EOFError) as err:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no head listening at {address[0]}:{address[1]} after {timeout:g} s "
                    f"(--data-parallel-connect-timeout): {err!r}"
                ) from None
            time.sleep(RETRY_S)


def replica_devices(
    device: str, replicas: int, tp: int, cuda_count: int, visible: str | None = None
) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` each of ``replicas`` cores on this machine gets: the
    r-th group of ``tp`` devices (of ``visible``, this process's own list, when set), or
    None: unchanged (the CPU, or one replica). Why the variable and not ``device="cuda:r"``:
    a core's tensor-parallel ranks sit on ``cuda:0`` .. ``cuda:tp-1`` of what it sees, and
    its kernels on the current device, so each replica must see only its own devices.
    ValueError when one device is named (``cuda:N``) or there are too few."""
    if replicas <= 1 or device == "cpu" or (device == "auto" and cuda_count == 0):
        return [None] * replicas
    if device not in ("auto", "cuda") and not device.startswith("cuda:"):
        return [None] * replicas  # not a device: the core refuses it by name
    if device.startswith("cuda:"):
        raise ValueError(
            f"--device {device} names one CUDA device, but each of the {replicas} data-"
            "parallel replicas here takes devices of its own: use --device cuda or auto"
        )
    need = replicas * tp
    if cuda_count < need:
        raise ValueError(
            f"{replicas} data-parallel replicas here x --tensor-parallel-size {tp} need "
            f"{need} CUDA devices, this machine has {cuda_count}"
        )
    ids = [v.strip() for v in visible.split(",")] if visible else list(map(str, range(need)))
    return [",".join(ids[r * tp : (r + 1) * tp]) for r in range(replicas)]


def local_devices(spec: CoreSpec, replicas: int) -> list[str | None]:
    """``replica_devices`` for ``replicas`` cores of ``spec`` on this machine (torch asked
    for its CUDA devices only when they matter)."""
    device = str(spec.llm_kwargs.get("device") or "auto")
    if replicas <= 1 or device == "cpu":
        return [None] * replicas
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = int(spec.llm_kwargs.get("tensor_parallel_size") or 1)
    return replica_devices(device, replicas, tp, count, os.environ.get(CUDA_VISIBLE))


@contextlib.contextmanager
def cuda_visible(devices: str | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set to ``devices`` while a core is started (a spawned
    child takes this process's environment), None: unchanged. Under a lock, so that
    replicas started at once each get their own."""
    if devices is None:
        yield
        return
    with _ENV_LOCK:
        before = os.environ.get(CUDA_VISIBLE)
        os.environ[CUDA_VISIBLE] = devices
        try:
            yield
        finally:
            if before is None:
                del os.environ[CUDA_VISIBLE]
            else:
                os.environ[CUDA_VISIBLE] = before


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
    devices = local_devices(spec, count)  # ValueError (too few) before any core starts
    ctx = multiprocessing.get_context("spawn")
    cores = [
        ctx.Process(
            target=headless_core,
            args=(replica_spec(spec, i), address, authkey, timeout),
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
    for core, visible in zip(cores, devices, strict=True):
        with cuda_visible(visible):
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
