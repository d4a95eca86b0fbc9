"""Data-parallel replicas on other hosts, the head's side: ``serve MODEL
--data-parallel-size N --data-parallel-size-local L --data-parallel-address A
--data-parallel-rpc-port P`` (vLLM's flags) spawns L engine cores here, as
``--data-parallel-size`` alone does, and waits for the other N - L, started on other hosts
by ``serve MODEL --headless`` (``dp_headless``), to connect to A:P and load their model.

Why the same wire: a headless core runs ``core_main`` over a TCP ``multiprocessing``
connection instead of a pipe, so on this side it is a ``CoreClient`` whose "process" is
that connection (``RemoteCore``): alive while it is open, dead once it closes or fails.
``DPClient`` routes to it like to a local core, and its death fails its own requests only;
the router skips it from then on. It is never restarted (this host cannot start a process
on another one); the server exits when its last replica, local or remote, is gone.

Why a key: the messages are pickles, and unpickling can run code, so a peer is let in only
once it has proved it knows the shared secret (``$PAGED_ENGINE_DP_AUTHKEY``, the same on
every node): ``multiprocessing.connection``'s HMAC challenge, both ways, before any
message. A peer with a wrong key is refused and the head waits on for a good one, until
``--data-parallel-connect-timeout``. The key authenticates but does not encrypt: the
replicas' network must be one you trust.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from paged_engine.entrypoints.core_client import KILL_WAIT_S, CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.entrypoints.settings import dp_authkey

log = logging.getLogger(__name__)


class ReplicaError(RuntimeError):
    """The head cannot gather its replicas: it refuses to serve (``serve`` exits 1)."""


def _name(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


class RemoteCore:
    """A remote core's connection, which ``CoreClient`` reads both as its core's pipe
    (``send``, ``recv``, ``poll``) and as its core's process (``is_alive``, ``join``,
    ``terminate``): the process is alive exactly while the connection is."""

    pid = None
    exitcode = None

    def __init__(self, conn: Connection, peer: str) -> None:
        self.conn = conn
        self.peer = peer
        self.ended = threading.Event()

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send(message)

    def recv(self) -> Any:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.ended.set()
            raise

    def poll(self, timeout: float) -> bool:
        try:
            return self.conn.poll(timeout)
        except OSError:
            self.ended.set()
            raise

    def is_alive(self) -> bool:
        return not self.ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the connection ends (the reader thread sees it close)."""
        self.ended.wait(timeout)

    def terminate(self) -> None:
        """Shut the connection down, both ways: a reader blocked on it wakes (a bare
        ``close`` would not wake it), and the core there sees it end and ends itself."""
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=self.conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
        self.ended.set()

    kill = terminate

    def close(self) -> None:
        self.terminate()
        self.conn.close()


class RemoteCoreClient(CoreClient):
    """A replica whose core runs on another host, over ``conn`` (accepted and
    authenticated by ``CoreListener``). ``launch`` waits for its model as for a local
    core's; ``stop`` sends ``("stop",)``, waits for the core to close the connection, then
    closes it (no process here to kill); it is never restarted."""

    def __init__(self, conn: Connection, peer: str, *, load_timeout: float = 600.0) -> None:
        super().__init__(CoreSpec(f"remote:{peer}"), restarts=0, load_timeout=load_timeout)
        self.remote = RemoteCore(conn, peer)

    def _spawn(self) -> tuple[Any, Any]:
        if self.remote.ended.is_set():  # restarts=0: not reached
            raise RuntimeError(f"the remote engine core at {self.remote.peer} is gone")
        return self.remote, self.remote

    def _died_why(self, process: Any) -> str:
        return f"the remote engine core at {self.remote.peer} disconnected"

    def stop(self, timeout: float = 10.0) -> bool:
        ended = super().stop(timeout)
        self.remote.close()
        return ended


class CoreListener:
    """The head's socket for remote cores, bound at once (a busy port is refused before
    any model loads). A thread accepts and authenticates the peers as they come, so that
    remote cores connect, and load, while the local ones load."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        try:
            self._listener = Listener(address, backlog=16, authkey=authkey)
        except OSError as err:
            where = _name(address)
            raise ReplicaError(
                f"--data-parallel-rpc-port: cannot listen on {where}: {err}"
            ) from None
        self.address = _name(self._listener.address)
        self.since = time.monotonic()
        self._accepted: queue.Queue[tuple[Connection, str]] = queue.Queue()
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name="dp-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn = self._listener.accept()
            except Exception as err:  # a wrong key (AuthenticationError), a peer that left
                if not self._closing:
                    peer = _name(self._listener.last_accepted)
                    log.warning("refused an engine core from %s: %r", peer, err)
                continue
            if self._closing:  # one too many: it sees its connection close
                conn.close()
            else:
                self._accepted.put((conn, _name(self._listener.last_accepted)))

    def replicas(
        self, count: int, connect_timeout: float, load_timeout: float = 600.0
    ) -> list[RemoteCoreClient]:
        """``count`` remote replicas, each loaded (its ``CoreInfo`` received); ReplicaError
        when fewer connect within ``connect_timeout`` of listening, or what refused a
        remote's model."""
        deadline = self.since + connect_timeout
        log.info("waiting for %d remote engine core(s) on %s", count, self.address)
        clients: list[RemoteCoreClient] = []
        try:
            while len(clients) < count:
                try:
                    conn, peer = self._accepted.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ReplicaError(
                        f"{count - len(clients)} of {count} remote engine cores did not connect "
                        f"to {self.address} within {connect_timeout:g} s "
                        "(--data-parallel-connect-timeout)"
                    ) from None
                clients.append(RemoteCoreClient(conn, peer, load_timeout=load_timeout))
                clients[-1].launch()
                log.info("remote engine core %d of %d ready, at %s", len(clients), count, peer)
        except BaseException:
            for client in clients:
                client.stop(0.0)
            raise
        return clients

    def close(self) -> None:
        """Stop accepting: a core that comes later finds nothing listening."""
        self._closing = True
        host, port = self._listener.address
        with contextlib.suppress(OSError):  # wakes the thread's accept()
            wake = "127.0.0.1" if host in ("0.0.0.0", "") else host
            socket.create_connection((wake, port), timeout=1.0).close()
        self._thread.join(KILL_WAIT_S)
        self._listener.close()
        while not self._accepted.empty():
            self._accepted.get_nowait()[0].close()


def launch_replicas(
    spec: CoreSpec,
    local: int,
    remote: int,
    *,
    address: tuple[str, int],
    restarts: int = 0,
    connect_timeout: float = 300.0,
) -> list[CoreClient]:
    """The head's replicas, all loaded: ``local`` cores spawned here, then ``remote`` ones
    from headless nodes (listening first, so they load while the local ones do). They must
    agree on what the router and the server read of the first (block size, block hash,
    max_model_len). On any failure every replica gathered so far is stopped."""
    listener = CoreListener(address, dp_authkey()) if remote else None
    cores: list[CoreClient] = []
    try:
        for _ in range(local):
            cores.append(CoreClient(spec, restarts=restarts))
            cores[-1].launch()
        if listener is not None:
            cores += listener.replicas(remote, connect_timeout)
        _check_alike(cores)
    except BaseException:
        for core in cores:
            core.stop(1.0)
        raise
    finally:
        if listener is not None:
            listener.close()
    return cores


def _check_alike(cores: list[CoreClient]) -> None:
    def shown(core: CoreClient) -> tuple[Any, ...]:
        info = core.info
        assert info is not None
        return info.block_size, info.prefix_cache_hash, info.max_model_len

    for core in cores[1:]:
        if shown(core) != shown(cores[0]):
            where = core.remote.peer if isinstance(core, RemoteCoreClient) else "here"
            raise ReplicaError(
                f"the replica at {where} has block size, block hash and max_model_len "
                f"{shown(core)}, the first {shown(cores[0])}: give every node the same "
                "engine flags"
            )
