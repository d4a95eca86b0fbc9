"""Tensor-parallel workers: rank 0's handle on ranks 1..N-1, spawned processes
(``tp_process.py``: what each is given, runs, and reports).

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
rank 0's own exception, the scheduler recovers the step as after any fault
(docs/design.md, "Atomic steps"), and the ``LLM`` is closed. A failure after the forward
pass (rank 0's sampler) is an ordinary fault: the workers had finished the step, and the
engine keeps serving.

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
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from contextlib import suppress
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.parallel import check_divisible
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker import distributed as tpd
from paged_engine.worker.devices import resolve_tp_device
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel, StepMessage
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.tp_process import WorkerError, WorkerProcess, WorkerSpec, worker_main

__all__ = [
    "SHUTDOWN_NOTE",
    "WorkerGroup",
    "add_note",
    "attach_runner",
    "start_tensor_parallel",
]

T = TypeVar("T")
logger = logging.getLogger("paged_engine")
JOIN_TIMEOUT_S = 10.0
"""How long ``close()`` waits for a worker to exit before killing it."""
REPORT_GRACE_S = 1.0
"""How long a failed step waits for a worker's exit code or error report."""
POLL_S = 0.25
"""How often rank 0, waiting on the collective thread, checks that every worker lives."""
DRAIN_S = 10.0
"""How long ``close()`` waits for rank 0's interrupted collective to fail once the
workers are gone (gloo: at once); past it the process group is left, not destroyed."""
SHUTDOWN_NOTE = "the tensor-parallel workers were shut down: a new LLM is needed"


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


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 (see the module docstring)."""

    report_grace_s = REPORT_GRACE_S

    def __init__(
        self, model: ModelConfig, config: EngineConfig, device: torch.device, transport: str
    ) -> None:
        if transport not in ("shm", "broadcast"):
            raise ValueError(f"transport must be 'shm' or 'broadcast', got {transport!r}")
        tpd.refuse_existing_group()
        timeout_s = tpd.collective_timeout_s()
        n = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.closed = False
        self.failed = False
        self.workers: list[WorkerProcess] = []
        self._store = tpd.open_store(n, timeout_s)
        signals = [ctx.Semaphore(0) for _ in range(n - 1)]
        self.channel: ShmChannel | BroadcastChannel = (
            ShmChannel(signals) if transport == "shm" else BroadcastChannel()
        )
        segment = self.channel.name if isinstance(self.channel, ShmChannel) else None
        backend = tpd.backend_for(device)
        spec = WorkerSpec(model, config, self._store.port, backend, segment, timeout_s)
        self._caller = tpd.CollectiveThread("paged_engine-tp0")
        try:
            for rank in range(1, n):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, spec, signals[rank - 1], send),
                    name=f"paged_engine-tp{rank}",
                    daemon=True,
                )
                proc.start()
                send.close()
                self.workers.append(WorkerProcess(rank, proc, recv))
            self._expect_all("started")
            self.tp = self._run(lambda: tpd.join_group(0, n, self._store, backend, timeout_s))
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    # ---- messages from the workers -------------------------------------------------------

    def _expect_all(self, kind: str) -> list[Any]:
        """Each worker's next message, which must be ``kind`` (``WorkerProcess.expect``)."""
        return [w.expect(kind) for w in self.workers]

    def wait_ready(self, num_blocks: int) -> None:
        """Every worker has built its runner with the agreed pool."""
        try:
            pools = self._expect_all("ready")
            if any(p != num_blocks for p in pools):
                raise WorkerError(f"KV pools disagree: rank 0 {num_blocks}, workers {pools}")
        except BaseException as err:
            raise self.fail(err)  # noqa: B904 - err itself, or its wrapper

    def _failures(self) -> list[str]:
        deadline = time.monotonic() + self.report_grace_s
        while True:
            found = [d for w in self.workers if (d := w.describe())]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    # ---- steps -------------------------------------------------------------------------------

    def forward(
        self,
        fn: Callable[[list[Sequence], bool], T],
        seqs: list[Sequence],
        is_prefill: bool,
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
        dead = [d for w in self.workers if not w.proc.is_alive() and (d := w.describe())]
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
        procs = [w.proc for w in self.workers]
        try:
            if not self.failed and hasattr(self, "tp"):
                with suppress(Exception):
                    self._run(lambda: self.channel.send(None))
                for proc in procs:
                    proc.join(JOIN_TIMEOUT_S)
        finally:  # also after a Ctrl-C in the clean exit: nothing is left behind
            for proc in procs:
                if proc.is_alive():  # a failed group's, or one that did not exit
                    proc.kill()  # SIGKILL ends a stopped worker too (SIGTERM would wait)
                proc.join()
            for w in self.workers:
                w.conn.close()
            self.channel.close()
            drained = self._caller.drain(DRAIN_S)  # its collective fails: peers are gone
            self._caller.stop()
            if drained:
                tpd.leave_group()
            else:  # destroying a group under a running collective could crash the process
                logger.warning("a collective ran on %.0f s after close: group left", DRAIN_S)


def start_tensor_parallel(
    model: ModelConfig,
    config: EngineConfig,
    transport: str = "shm",
    *,
    eos_token_ids: SequenceABC[int] = (),
) -> ModelRunner:
    """Rank 0's runner with ``config.tensor_parallel_size - 1`` workers behind it, every
    rank built from ``model`` (the workers get it in their spec: none reads config.json).

    Refused before any process starts: a model the ranks cannot shard evenly (naming the
    field), a device string naming one CUDA device, fewer CUDA devices than ranks, and a
    process that already has a process group."""
    n = config.tensor_parallel_size
    if n < 2:
        raise ValueError(f"tensor_parallel_size={n}: a tensor-parallel group needs 2 or more")
    check_divisible(model.hf_config, n)
    group = WorkerGroup(model, config, resolve_tp_device(config.device, n), transport)
    return attach_runner(group, model, config, eos_token_ids)


def attach_runner(
    group: WorkerGroup, model: ModelConfig, config: EngineConfig, eos_token_ids: SequenceABC[int]
) -> ModelRunner:
    """Rank 0's runner, built once ``group``'s workers have joined, with the group behind
    it (whatever started the workers: this module, or ``ray_executor.py``)."""
    try:
        runner = ModelRunner(model, config, tp=group.tp, eos_token_ids=eos_token_ids)
    except BaseException as err:
        raise group.fail(err)  # noqa: B904 - err itself, or its wrapper
    group.wait_ready(runner.num_kvcache_blocks)
    runner.workers = group
    return runner
