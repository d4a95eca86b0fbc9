"""A tensor-parallel rank as a Ray actor: the actor class (``RankActor``, wrapped by
``ray.remote`` where Ray is imported, in ``ray_executor.py``), the wake-up signal of the
shared-memory hand-off between processes that do not inherit from each other
(``FifoSignal``), and rank 0's view of one actor (``RayRank``).

Ray is imported by the caller, never here at import time: ``paged_engine`` runs without
it. The actor runs the same ``run_rank`` as a spawned worker (``tp_process.py``).
"""

from __future__ import annotations

import os
import queue
import select
import time
from collections.abc import Callable
from typing import Any

from paged_engine.ray_support import actor_location
from paged_engine.worker.handoff import BroadcastChannel, ShmReader
from paged_engine.worker.tp_process import STARTUP_TIMEOUT_S, WorkerError, WorkerSpec

__all__ = ["IDLE_TIMEOUT_S", "FifoSignal", "RankActor", "RayRank"]

IDLE_TIMEOUT_S = 365 * 24 * 3600.0
"""The broadcast hand-off's timeout (``BroadcastChannel.idle_timeout_s``): an idle engine
keeps its actors; a dead actor is still noticed at once (its connections close)."""
REPORT_POLL_S = 0.2
"""How long one call for an actor's next report waits before rank 0 checks on it."""


class FifoSignal:
    """A counting wake-up over a named pipe, with ``multiprocessing.Semaphore``'s
    ``release`` / ``acquire(timeout=)``: one byte per message.

    Why: ``ShmChannel`` wakes its workers with semaphores that only spawned children
    inherit; a Ray actor is started by Ray's raylet, not by rank 0, but shares rank 0's
    node and so its file system. Both ends open the pipe read-write, so that neither
    blocks on open nor sees end-of-file when the other goes, and rank 0's writes never
    block (a worker is at most one message behind: the ranks run steps in lock step)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def release(self) -> None:
        os.write(self.fd, b"\0")

    def acquire(self, timeout: float) -> bool:
        """Take one byte; False when none came within ``timeout`` seconds."""
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return False
        try:
            return len(os.read(self.fd, 1)) == 1
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)


class RankActor:
    """What runs in the actor: ``run`` (the rank's whole life, a long call) and the calls
    rank 0 makes beside it (``where``, ``next_report``), hence ``max_concurrency=2``.

    A rank that raises ends ``run`` with the exception (Ray hands rank 0 the traceback);
    its connections stay open until rank 0 kills the actor, which it does as soon as it
    sees ``run`` end (``RayRank.describe``, polled while a step waits). Rank 0's death
    ends the actor too: Ray kills an actor whose owner is gone, so an idle worker needs
    no liveness check of its own."""

    def __init__(self) -> None:
        self._reports: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def where(self) -> tuple[str, str, int]:
        """This actor's node id, node address and pid."""
        return actor_location()

    def run(
        self, entry: Callable[..., None], rank: int, spec: WorkerSpec, fifo: str | None
    ) -> None:
        """``entry`` (``tp_process.run_rank``) with this node's end of the hand-off."""
        channel: Any
        if spec.segment is None:
            channel = BroadcastChannel(IDLE_TIMEOUT_S)
        else:
            assert fifo is not None, "the shared-memory hand-off needs its wake-up pipe"
            channel = ShmReader(spec.segment, FifoSignal(fifo), lambda: True)
        entry(rank, spec, channel, self._reports.put)

    def next_report(self, timeout_s: float) -> tuple[str, Any] | None:
        try:
            return self._reports.get(timeout=timeout_s)
        except queue.Empty:
            return None


class RayRank:
    """One actor as rank 0 sees it, with the interface ``WorkerGroup`` uses of a spawned
    worker (``WorkerProcess``: ``expect``, ``describe``, ``pid``; ``proc.is_alive``,
    ``kill``, ``join``; ``conn.close``), so that the group's steps, failures and close
    are the same code for both backends. ``run_ref`` is the actor's ``run`` call: it
    resolves only when the rank ended (told to exit, raised, or killed)."""

    def __init__(self, ray: Any, rank: int, actor: Any, pid: int, node_ip: str) -> None:
        self.ray = ray
        self.rank = rank
        self.actor = actor
        self.node_ip = node_ip
        self._pid = pid
        self.run_ref: Any = None
        self.proc = self
        self.conn = self

    @property
    def pid(self) -> int:
        return self._pid

    def is_alive(self) -> bool:
        if not self.ray.is_initialized():  # Ray was shut down first (interpreter exit)
            return False
        if self.run_ref is None:
            return True
        ready, _ = self.ray.wait([self.run_ref], timeout=0)
        return not ready

    def kill(self) -> None:
        if self.ray.is_initialized():
            self.ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        if self.run_ref is not None and self.ray.is_initialized():
            self.ray.wait([self.run_ref], timeout=timeout)

    def close(self) -> None:
        return None

    def expect(self, kind: str) -> Any:
        """The actor's next report, which must be ``kind``; WorkerError when its ``run``
        ends first or it stays silent for ``STARTUP_TIMEOUT_S``."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                got = self.ray.get(self.actor.next_report.remote(REPORT_POLL_S))
            except self.ray.exceptions.RayError:
                got = None
            if got is not None:
                if got[0] != kind:
                    raise WorkerError(f"worker rank {self.rank} sent {got[0]!r}, expected {kind!r}")
                return got[1]
            if not self.is_alive():
                raise WorkerError(self.describe() or f"worker rank {self.rank} exited")
        raise WorkerError(f"worker rank {self.rank} sent nothing for {STARTUP_TIMEOUT_S:.0f} s")

    def describe(self) -> str | None:
        """How the actor's rank ended (its traceback, or that the actor died); None while
        it runs."""
        if self.is_alive():
            return None
        who = (
            f"tensor-parallel worker rank {self.rank} "
            f"(Ray actor, pid {self._pid} on {self.node_ip})"
        )
        if not self.ray.is_initialized():
            return f"{who} ended: Ray was shut down"
        try:
            self.ray.get(self.run_ref, timeout=0)
        except self.ray.exceptions.RayTaskError as err:
            return f"{who} raised:\n{str(err)[-16000:]}"
        except self.ray.exceptions.RayError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return f"{who} died (the actor is gone: killed, or its process or node died): {first}"
        return f"{who} exited"
