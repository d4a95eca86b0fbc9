"""Tensor-parallel workers: ranks 1..N-1 as spawned processes, and rank 0's handle on them.

Rank 0 (the caller's process) runs the scheduler, the allocator and the sampler; every
rank builds the same ``ModelRunner`` on its shard of the model (``layers/parallel.py``)
with its share of the KV heads. Each step rank 0 hands the scheduled sequences over
(``handoff.py``) and all ranks run ``ModelRunner._forward`` together: the same code, so
the same collectives in the same order. Workers discard their results.

**Failures.** A worker that raises sends its traceback to rank 0 over a pipe and exits;
one that is killed just disappears; one that is stopped (SIGSTOP, a debugger) or hangs
stays alive but never reaches the next collective. Rank 0 runs each step on
``distributed.CollectiveThread`` and waits for it, checking every ``POLL_S`` that the
workers live: a dead worker fails the step at once (gloo also fails the collective as
soon as the peer's connection closes), a stopped or hung one within the collective
timeout (``distributed.collective_timeout_s``), named as stopped when it is, and a
Ctrl-C is taken at once, however long the collective would have blocked. Any failure
while the ranks run a step together (a Ctrl-C included) leaves their collectives out of
step, so the group is shut down: the step raises ``WorkerError`` (a worker failed) or
rank 0's own exception, the scheduler recovers the step as after any fault ("Atomic
steps"), and the ``LLM`` is closed. A failure after the forward pass (rank 0's sampler)
is an ordinary fault: the workers had finished the step, and the engine keeps serving.

**Lifecycle.** ``WorkerGroup.close()`` asks the workers to exit, kills any that do not
(at once after a failure), and destroys the process group; ``LLM.close()``, its
``with`` block and a ``weakref.finalize`` (garbage collection, interpreter exit) call it.
Workers are daemonic and poll for rank 0's death while idle, so none outlives rank 0.
The costs: one spawn per worker (a fresh interpreter importing torch: seconds), and the
caller's ``__main__`` must be importable without side effects (the usual
``if __name__ == "__main__":`` guard), as for any spawned process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.parallel import check_divisible
from paged_engine.utils.model_config import load_config
from paged_engine.worker import distributed as tpd
from paged_engine.worker.devices import resolve_tp_device
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel, ShmReader, StepMessage
from paged_engine.worker.model_runner import ModelRunner

T = TypeVar("T")
logger = logging.getLogger("paged_engine")
JOIN_TIMEOUT_S = 10.0
"""How long ``close()`` waits for a worker to exit before killing it."""
REPORT_GRACE_S = 1.0
"""How long a failed step waits for a worker's exit code or error report."""
POLL_S = 0.25
"""How often rank 0, waiting on the collective thread, checks that every worker lives."""
STARTUP_TIMEOUT_S = 600.0
"""The longest a worker may stay silent while it starts (spawn, imports, its runner and
its weights: a large checkpoint takes minutes). The wait polls, so a worker's death or
a Ctrl-C ends it at once."""
DRAIN_S = 10.0
"""How long ``close()`` waits for rank 0's interrupted collective to fail once the
workers are gone (gloo: at once); past it the process group is left, not destroyed."""
SHUTDOWN_NOTE = "the tensor-parallel workers were shut down: a new LLM is needed"


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, died or stopped; the group was shut down."""


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)``, also on Python 3.10, which has no ``add_note``: there the
    note goes where 3.11 keeps notes (``__notes__``) and, as 3.10's tracebacks do not
    print those, onto the message when ``err`` has a single string argument."""
    native = getattr(err, "add_note", None)
    if native is not None:
        native(note)
        return
    notes = getattr(err, "__notes__", None)
    err.__notes__ = [*(notes if isinstance(notes, list) else []), note]
    if len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}",)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    model_dir: str
    config: EngineConfig
    store_port: int
    backend: str
    segment: str | None
    """The shared-memory segment's name; None for the broadcast hand-off."""
    timeout_s: float
    """The collective timeout, rank 0's (``distributed.collective_timeout_s``)."""


def worker_main(rank: int, spec: WorkerSpec, signal_: Any, conn: Any) -> None:
    """Rank ``rank``: join the group, build the runner, run steps until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    parent = mp.parent_process()
    try:
        conn.send(("started", os.getpid()))
        world = spec.config.tensor_parallel_size
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
        store = tpd.connect_store(spec.store_port, world, spec.timeout_s)
        tp = tpd.join_group(rank, world, store, spec.backend, spec.timeout_s)
        runner = ModelRunner(spec.model_dir, spec.config, tp=tp)
        conn.send(("ready", runner.num_kvcache_blocks))
        alive = parent.is_alive if parent is not None else (lambda: True)
        channel = (
            BroadcastChannel() if spec.segment is None else ShmReader(spec.segment, signal_, alive)
        )
        while (message := channel.receive()) is not None:
            runner.run_worker(message.restore(), message.is_prefill)
        channel.close()
        tpd.leave_group()
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


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 (see the module docstring)."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig, device: torch.device, transport: str
    ) -> None:
        if transport not in ("shm", "broadcast"):
            raise ValueError(f"transport must be 'shm' or 'broadcast', got {transport!r}")
        tpd.refuse_existing_group()
        timeout_s = tpd.collective_timeout_s()
        n = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.closed = False
        self.failed = False
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._store = tpd.open_store(n, timeout_s)
        signals = [ctx.Semaphore(0) for _ in range(n - 1)]
        self.channel: ShmChannel | BroadcastChannel = (
            ShmChannel(signals) if transport == "shm" else BroadcastChannel()
        )
        segment = self.channel.name if isinstance(self.channel, ShmChannel) else None
        backend = tpd.backend_for(device)
        spec = WorkerSpec(str(model_dir), config, self._store.port, backend, segment, timeout_s)
        self._caller = tpd.CollectiveThread("paged_engine-tp0")
        try:
            for rank in range(1, n):
                recv, send = ctx.Pipe(duplex=False)
                # looked up at call time, so tests can start patched workers (tests/tp_mutants.py)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, spec, signals[rank - 1], send),
                    name=f"paged_engine-tp{rank}",
                    daemon=True,
                )
                proc.start()
                send.close()
                self.procs.append(proc)
                self.conns.append(recv)
            self._wait_all("started")
            self.tp = self._run(lambda: tpd.join_group(0, n, self._store, backend, timeout_s))
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- messages from the workers -------------------------------------------------------

    def _wait_all(self, kind: str) -> list[Any]:
        """Each worker's next message, which must be ``kind``; WorkerError when one
        reports an error, dies, or stays silent for ``STARTUP_TIMEOUT_S``."""
        values = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise WorkerError(self._describe(rank) or f"worker rank {rank} exited")
                if time.monotonic() > deadline:
                    silent = STARTUP_TIMEOUT_S
                    raise WorkerError(f"worker rank {rank} sent nothing for {silent:.0f} s")
            got, value = conn.recv()
            if got == "error":
                raise WorkerError(f"tensor-parallel worker rank {rank} raised:\n{value}")
            if got != kind:
                raise WorkerError(f"worker rank {rank} sent {got!r}, expected {kind!r}")
            values.append(value)
        return values

    def wait_ready(self, num_blocks: int) -> None:
        """Every worker has built its runner with the agreed pool."""
        try:
            pools = self._wait_all("ready")
            if any(p != num_blocks for p in pools):
                raise WorkerError(f"KV pools disagree: rank 0 {num_blocks}, workers {pools}")
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    def _describe(self, rank: int) -> str | None:
        """What became of worker ``rank``: its error report, how it exited, or that it is
        stopped; None while it is alive, running and silent."""
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        with suppress(EOFError, OSError):
            while conn.poll():
                got, value = conn.recv()
                if got == "error":
                    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) raised:\n{value}"
        if proc.is_alive():  # also reaps it when it has exited
            if tpd.process_state(proc.pid) in ("T", "t"):
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) is stopped (SIGSTOP, "
                    "job control or a debugger): it could not take part in the step"
                )
            return None
        code = proc.exitcode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({how})"

    def _failures(self) -> list[str]:
        deadline = time.monotonic() + REPORT_GRACE_S
        while True:
            found = [d for r in range(1, len(self.procs) + 1) if (d := self._describe(r))]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    # ---- steps -------------------------------------------------------------------------------

    def forward(
        self, fn: Callable[[list[Sequence], bool], T], seqs: list[Sequence], is_prefill: bool
    ) -> T:
        """Hand the step to the workers, then run ``fn`` (rank 0's forward pass) with them."""
        if self.closed:
            raise RuntimeError(
                "this LLM's tensor-parallel workers were shut down (close(), or a failed "
                "step): build a new LLM"
            )
        try:
            self._check_alive()
            message = StepMessage.of(seqs, is_prefill)

            def step() -> T:
                self.channel.send(message)  # a collective for the broadcast hand-off
                return fn(seqs, is_prefill)

            return self._run(step)
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    def _run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the collective thread, waited for here: every ``POLL_S`` this
        thread checks the workers (WorkerError for one that died, without waiting for
        the collective to notice), and a KeyboardInterrupt ends the wait at once."""
        call = self._caller.submit(fn)
        while not call.wait(POLL_S):
            self._check_alive()
        return call.result()

    def _check_alive(self) -> None:
        procs = enumerate(self.procs, 1)
        dead = [d for r, p in procs if not p.is_alive() and (d := self._describe(r))]
        if dead:
            raise WorkerError("\n".join(dead))

    def fail(self, err: BaseException) -> BaseException:
        """Shut the group down after ``err``; the exception to raise: a ``WorkerError``
        naming the failed workers when ``err`` is a RuntimeError (what a collective raises
        when a peer is gone) or a WorkerError, else ``err`` itself with a note."""
        failures = self._failures() if not isinstance(err, WorkerError) else []
        self.failed = True
        self.close()
        if isinstance(err, WorkerError):
            add_note(err, SHUTDOWN_NOTE)
            return err
        if failures and isinstance(err, RuntimeError):
            wrapped = WorkerError("\n".join(failures))
            wrapped.__cause__ = err
            add_note(wrapped, SHUTDOWN_NOTE)
            return wrapped
        add_note(err, "\n".join([*failures, SHUTDOWN_NOTE]))
        return err

    def close(self) -> None:
        """End the workers and the process group (idempotent; see the module docstring)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.failed and hasattr(self, "tp"):
                with suppress(Exception):
                    self._run(lambda: self.channel.send(None))
                for proc in self.procs:
                    proc.join(JOIN_TIMEOUT_S)
        finally:  # also after a Ctrl-C in the clean exit: nothing is left behind
            for proc in self.procs:
                if proc.is_alive():  # a failed group's, or one that did not exit
                    proc.kill()  # SIGKILL ends a stopped worker too (SIGTERM would wait)
                proc.join()
            for conn in self.conns:
                conn.close()
            self.channel.close()
            drained = self._caller.drain(DRAIN_S)  # its collective fails: peers are gone
            self._caller.stop()
            if drained:
                tpd.leave_group()
            else:  # destroying a group under a running collective could crash the process
                logger.warning("a collective ran on %.0f s after close: group left", DRAIN_S)


def start_tensor_parallel(
    model_dir: str | Path, config: EngineConfig, transport: str = "shm"
) -> ModelRunner:
    """Rank 0's runner with ``config.tensor_parallel_size - 1`` workers behind it.

    Refused before any process starts: a model the ranks cannot shard evenly (naming the
    field), a device string naming one CUDA device, fewer CUDA devices than ranks, and a
    process that already has a process group."""
    n = config.tensor_parallel_size
    if n < 2:
        raise ValueError(f"tensor_parallel_size={n}: a tensor-parallel group needs 2 or more")
    check_divisible(load_config(Path(model_dir)), n)
    group = WorkerGroup(model_dir, config, resolve_tp_device(config.device, n), transport)
    try:
        runner = ModelRunner(model_dir, config, tp=group.tp)
    except BaseException as err:
        raise group.fail(err)  # noqa: B904 - err itself, or its wrapper
    group.wait_ready(runner.num_kvcache_blocks)
    runner.workers = group
    return runner
