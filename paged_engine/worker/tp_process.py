"""A tensor-parallel worker process: what it is given (``WorkerSpec``), what it runs
(``worker_main``), and rank 0's view of it (``WorkerProcess``).

A worker reports on a one-way pipe to rank 0: ``("started", pid)`` once spawned,
``("ready", num_blocks)`` once its runner is built with the agreed pool, and
``("error", traceback)`` before it exits on a failure. The group (``tp_worker.py``) reads
these through ``WorkerProcess``, which also tells how a silent worker ended (killed,
exited, or stopped by a signal or a debugger).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from paged_engine.config import EngineConfig
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker import distributed as tpd
from paged_engine.worker.handoff import BroadcastChannel, ShmReader
from paged_engine.worker.model_runner import ModelRunner

__all__ = [
    "STARTUP_TIMEOUT_S",
    "WorkerError",
    "WorkerProcess",
    "WorkerSpec",
    "run_rank",
    "worker_main",
]

STARTUP_TIMEOUT_S = 600.0
"""The longest a worker may stay silent while it starts (spawn, imports, its runner and
its weights: a large checkpoint takes minutes). The wait polls, so a worker's death or
a Ctrl-C ends it at once."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, died or stopped; the group was shut down."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build its rank, pickled into the spawned process."""

    model: ModelConfig
    """The model's config as rank 0 read and validated it: no worker reads config.json."""
    config: EngineConfig
    store_port: int
    backend: str
    segment: str | None
    """The shared-memory segment's name; None for the broadcast hand-off."""
    timeout_s: float
    """The collective timeout, rank 0's (``distributed.collective_timeout_s``)."""
    store_host: str = "127.0.0.1"
    """Where rank 0's store is: loopback for spawned workers, rank 0's node address for
    Ray actors (``ray_executor.py``), which may run on another node."""


def worker_main(rank: int, spec: WorkerSpec, signal_: Any, conn: Any) -> None:
    """Rank ``rank`` in a spawned process: ``run_rank``, its reports on ``conn``, and on
    a failure its traceback there and an immediate exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    parent = mp.parent_process()
    try:
        conn.send(("started", os.getpid()))
        alive = parent.is_alive if parent is not None else (lambda: True)
        channel = (
            BroadcastChannel() if spec.segment is None else ShmReader(spec.segment, signal_, alive)
        )
        run_rank(rank, spec, channel, conn.send)
    except BaseException:
        with suppress(Exception):
            # the tail only: a pipe holds 64 KiB, and rank 0 may not be reading yet
            conn.send(("error", traceback.format_exc()[-16000:]))
        os._exit(1)  # closes this rank's connections: rank 0's collectives fail at once
    # Nothing is left to clean up; tearing the interpreter down (torch's modules) would
    # take about a second, which close() and interpreter exit would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(
    rank: int, spec: WorkerSpec, channel: Any, report: Callable[[tuple[str, Any]], None]
) -> None:
    """A worker rank's life, whatever runs it (a spawned process, a Ray actor): join the
    group, build the runner, ``report(("ready", num_blocks))``, run the steps ``channel``
    hands over until told to exit. Raises on a failure; the caller reports it."""
    world = spec.config.tensor_parallel_size
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
    store = tpd.connect_store(spec.store_port, world, spec.timeout_s, spec.store_host)
    tp = tpd.join_group(rank, world, store, spec.backend, spec.timeout_s)
    runner = ModelRunner(spec.model, spec.config, tp=tp)
    report(("ready", runner.num_kvcache_blocks))
    while (message := channel.receive()) is not None:
        runner.run_worker(message.restore(), message.is_prefill)
    channel.close()
    tpd.leave_group()


class WorkerProcess:
    """One spawned rank as rank 0 sees it: the process and the pipe it reports on."""

    def __init__(self, rank: int, proc: Any, conn: Any) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def expect(self, kind: str) -> Any:
        """The worker's next message, which must be ``kind``; WorkerError when it reports
        an error, dies, or stays silent for ``STARTUP_TIMEOUT_S``."""
        rank = self.rank
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise WorkerError(self.describe() or f"worker rank {rank} exited")
            if time.monotonic() > deadline:
                silent = STARTUP_TIMEOUT_S
                raise WorkerError(f"worker rank {rank} sent nothing for {silent:.0f} s")
        got, value = self.conn.recv()
        if got == "error":
            raise WorkerError(f"tensor-parallel worker rank {rank} raised:\n{value}")
        if got != kind:
            raise WorkerError(f"worker rank {rank} sent {got!r}, expected {kind!r}")
        return value

    def describe(self) -> str | None:
        """What became of the worker: its error report, how it exited, or that it is
        stopped; None while it is alive, running and silent."""
        who = f"tensor-parallel worker rank {self.rank} (pid {self.proc.pid})"
        with suppress(EOFError, OSError):
            while self.conn.poll():
                got, value = self.conn.recv()
                if got == "error":
                    return f"{who} raised:\n{value}"
        if self.proc.is_alive():  # also reaps it when it has exited
            if tpd.process_state(self.proc.pid) in ("T", "t"):
                return (
                    f"{who} is stopped (SIGSTOP, job control or a debugger): it could not "
                    "take part in the step"
                )
            return None
        code = self.proc.exitcode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return f"{who} died ({how})"
