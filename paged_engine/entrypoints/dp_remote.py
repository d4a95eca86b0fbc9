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
replicas' network must be one you trust. Each peer is authenticated on a thread of its
own, within ``AUTH_TIMEOUT_S``: a connection that says nothing cannot hold the others off.
Both ends keep the connection alive (``dp_headless.keep_alive``): a node that vanishes
without closing it is counted dead within about 15 s.

All replicas launch at once (N loads take one load's time, not N); on any failure every
other one, loaded or loading, is ended, then the first error raised.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from paged_engine.cpu_bind import replica_specs
from paged_engine.entrypoints.core_client import KILL_WAIT_S, CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.entrypoints.dp_client import LocalCoreClient, stop_all
from paged_engine.entrypoints.dp_headless import authenticated, local_devices, shut_down
from paged_engine.entrypoints.settings import dp_authkey

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.1
"""How often the accepting thread looks whether the listener is closing."""
MAX_AUTHENTICATING = 16
"""Connections authenticated at once; one more is closed unread (silent connections
cannot pile up threads)."""


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
        """Shut the connection down, both ways: the reader wakes, the core there ends."""
        shut_down(self.conn)
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
    any model loads). A thread accepts the peers as they come, and one per peer
    authenticates it, so that remote cores connect, and load, while the local ones load."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        try:
            self._sock = socket.create_server(address, backlog=16)
        except OSError as err:
            why = f"--data-parallel-rpc-port: cannot listen on {_name(address)}: {err}"
            raise ReplicaError(why) from None
        self._sock.settimeout(ACCEPT_POLL_S)
        self.address = _name(self._sock.getsockname()[:2])
        self.since = time.monotonic()
        self._authkey = authkey
        self._accepted: queue.Queue[tuple[Connection, str] | None] = queue.Queue()
        self._closing = threading.Event()
        self._gate = threading.Lock()  # orders a peer's admission and ``close``
        self._slots = threading.BoundedSemaphore(MAX_AUTHENTICATING)
        self._launching: RemoteCoreClient | None = None
        self._thread = threading.Thread(target=self._accept, name="dp-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                sock, address = self._sock.accept()
            except TimeoutError:  # the poll's: is it closing?
                continue
            except OSError as err:  # out of descriptors, say: again, shortly
                log.warning("accepting an engine core failed: %r", err)
                time.sleep(ACCEPT_POLL_S)
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("refused an engine core from %s: too many connecting", _name(address))
                sock.close()
                continue
            threading.Thread(
                target=self._admit, args=(sock, _name(address)), name="dp-auth", daemon=True
            ).start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            conn = authenticated(sock, self._authkey, server=True)
        except Exception as err:  # a wrong key (AuthenticationError), silence, a peer that left
            if not self._closing.is_set():
                log.warning("refused an engine core from %s: %r", peer, err)
            return
        finally:
            self._slots.release()
        with self._gate:
            if self._closing.is_set():  # one too many: it sees its connection close
                conn.close()
            else:
                self._accepted.put((conn, peer))

    def replicas(
        self, count: int, connect_timeout: float, load_timeout: float = 600.0
    ) -> list[RemoteCoreClient]:
        """``count`` remote replicas, each loaded (its ``CoreInfo`` received); ReplicaError
        when fewer connect within ``connect_timeout`` of listening, or the listener is
        closed meanwhile, or what refused a remote's model."""
        deadline = self.since + connect_timeout
        log.info("waiting for %d remote engine core(s) on %s", count, self.address)
        clients: list[RemoteCoreClient] = []
        try:
            while len(clients) < count:
                try:
                    item = self._accepted.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ReplicaError(
                        f"{count - len(clients)} of {count} remote engine cores did not connect "
                        f"to {self.address} within {connect_timeout:g} s "
                        "(--data-parallel-connect-timeout)"
                    ) from None
                with self._gate:
                    if item is None or self._closing.is_set():
                        raise ReplicaError("stopped waiting for the remote engine cores")
                    clients.append(RemoteCoreClient(*item, load_timeout=load_timeout))
                    self._launching = clients[-1]
                clients[-1].launch()
                log.info("remote engine core %d of %d ready, at %s", len(clients), count, item[1])
        except BaseException:
            stop_all(clients, 0.0)
            raise
        return clients

    def close(self) -> None:
        """Stop accepting (a core that comes later finds nothing listening) and end a
        remote's launch under way: ``replicas`` then fails at once."""
        with self._gate:
            self._closing.set()
            launching, self._launching = self._launching, None
        if launching is not None and launching.info is None:
            launching.remote.terminate()
        self._thread.join(KILL_WAIT_S)
        self._sock.close()
        while not self._accepted.empty():
            item = self._accepted.get_nowait()
            if item is not None:
                item[0].close()
        self._accepted.put(None)  # wakes ``replicas``


def launch_replicas(
    spec: CoreSpec,
    local: int,
    remote: int,
    *,
    address: tuple[str, int],
    restarts: int = 0,
    connect_timeout: float = 300.0,
) -> list[CoreClient]:
    """The head's replicas, all loaded: ``local`` cores spawned here, each on its own CUDA
    devices (ValueError before anything starts when there are too few), and ``remote``
    ones from headless nodes, all at once. They must agree on what the router and the
    server read of the first (block size, block hash, max_model_len). On any failure
    every replica is ended, then the first error raised."""
    devices = local_devices(spec, local)
    listener = CoreListener(address, dp_authkey()) if remote else None
    here = [LocalCoreClient(s, d, restarts=restarts) for s, d in replica_specs(spec, devices)]
    jobs: list[Callable[[], Any]] = [core.launch for core in here]
    if listener is not None:
        jobs.append(lambda: listener.replicas(remote, connect_timeout))
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(jobs)), "dp-launch")
    futures = [pool.submit(job) for job in jobs]
    try:
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:  # the first failure, in replica order
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        cores: list[CoreClient] = [*here, *(futures[-1].result() if listener else ())]
        _check_alike(cores)
    except BaseException:
        for core in here:  # a core still loading ends at once
            core.give_up()
        if listener is not None:
            listener.close()
        concurrent.futures.wait(futures)
        remotes = [c for f in futures[len(here) :] if not f.exception() for c in f.result()]
        stop_all([*here, *remotes], 1.0)
        raise
    finally:
        pool.shutdown(wait=False)
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
