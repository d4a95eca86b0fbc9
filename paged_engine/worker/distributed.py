"""torch.distributed for the tensor-parallel ranks: the store they meet at, the process
group (gloo on CPU, NCCL on CUDA, one device per rank), the one value they must agree
on before serving (the KV pool's size in blocks), and the thread rank 0 runs its
collectives on.

All ranks run on this machine: rank 0 in the caller's process, ranks 1..N-1 in workers it
spawns (``tp_worker.py``). They meet at a ``TCPStore`` that rank 0 opens on a free
loopback port (port 0: the kernel picks one, so two engines never race for a port).
With Ray (``ray_executor.py``) ranks 1..N-1 are actors, possibly on other nodes: the store
listens on every interface and they connect to rank 0's node address.

**The collective timeout** (``collective_timeout_s``: ``DEFAULT_COLLECTIVE_TIMEOUT_S``,
or the ``PAGED_ENGINE_TP_TIMEOUT_S`` environment variable) bounds how long a rank waits
in one collective, or for the others to join the group. A collective waits only for the
other ranks to reach the same point of the same forward pass over the same shapes, so
its wait is the ranks' lag at that point, a fraction of one step, not a step's length;
the longest wait in normal running is at start-up, where the pool agreement after a
CUDA pool measurement waits for the slower rank's weight loading. A minute is far above
both for the models this engine serves and still reports a hung or stopped rank within
a minute; raise the variable for checkpoints whose shards load slowly. A worker that
dies is noticed sooner (gloo reports the closed connection at once, and rank 0 polls
its workers while it waits), and a Ctrl-C at once (``CollectiveThread``).
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist

from paged_engine.layers.parallel import TPGroup

T = TypeVar("T")
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # not in torch's stubs' exports

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
"""The collective timeout unless ``TIMEOUT_ENV`` sets another (module docstring)."""
TIMEOUT_ENV = "PAGED_ENGINE_TP_TIMEOUT_S"


def collective_timeout_s() -> float:
    """The collective timeout in seconds: ``TIMEOUT_ENV`` when set (a number > 0), else
    ``DEFAULT_COLLECTIVE_TIMEOUT_S``. Read when a group starts; every rank gets rank 0's."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def refuse_existing_group() -> None:
    """One tensor-parallel group per process: torch.distributed's default group is
    process-wide state."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process (another "
            "tensor-parallel LLM, or torchrun's): close that LLM, or destroy the group, first"
        )


def open_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's store, on a loopback port the kernel picks (``.port``)."""
    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def connect_store(port: int, world_size: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """A worker's connection to rank 0's store at ``host`` (the store listens on every
    interface: a worker on another node gives rank 0's node address)."""
    return TCPStore(
        host,
        port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def join_group(rank: int, world_size: int, store: Any, backend: str, timeout_s: float) -> TPGroup:
    """Create this process's default process group; blocks until every rank has joined
    (at most ``timeout_s``, which also bounds every later collective of the group)."""
    refuse_existing_group()
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        # NCCL binds rank r to cuda:r, whatever the process's current device
        device_id=torch.device("cuda", rank) if backend == "nccl" else None,
    )
    return TPGroup(rank, world_size)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` (``T``: stopped), where /proc
    has it; None elsewhere or once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def leave_group() -> None:
    """Destroy the default process group, if any (safe after a peer died, under gloo)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (every rank must call it)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class PendingCall(Generic[T]):
    """A call submitted to a ``CollectiveThread``: ``wait`` for it, then its ``result``.

    A lock the thread releases when the call ends, not a ``concurrent.futures.Future``:
    a step waits on one per step, and this is the cheaper hand-back (one futex wake, no
    condition or waiter list). ``Lock.acquire`` with a timeout is interruptible: a
    KeyboardInterrupt raised in the waiting thread ends ``wait``, the call runs on."""

    __slots__ = ("_done", "_ended", "_error", "_fn", "_threads", "_value")

    def __init__(self, fn: Callable[[], T], threads: int) -> None:
        self._fn = fn
        self._threads = threads
        self._done = threading.Lock()
        self._done.acquire()
        self._ended = False
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the call (on the collective thread) and release its waiter."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        try:
            self._value = self._fn()
        except BaseException as err:  # handed to the waiting thread
            self._error = err
        finally:
            self._done.release()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the call to end; whether it has."""
        if not self._ended and self._done.acquire(timeout=timeout_s):
            self._ended = True
        return self._ended

    def result(self) -> T:
        """The call's value, or its exception raised here (after ``wait`` said it ended)."""
        if self._error is not None:
            raise self._error
        return cast(T, self._value)


class CollectiveThread:
    """One daemon thread on which rank 0 makes the calls that enter collectives (the
    group's rendezvous, each step's hand-off and forward pass).

    Why: a thread blocked inside a gloo or NCCL collective is in C++ and runs no Python
    signal handler until the call returns, which for a stopped or hung peer is the
    collective timeout; a Ctrl-C would wait that long. With the call on this thread, the
    caller's thread waits on a ``PendingCall``, which a KeyboardInterrupt interrupts at
    once, and checks between waits that the workers still live (``WorkerGroup._run``).
    A caller that gives up shuts the group down, which ends the call here too (a killed
    peer's closed connection fails the collective), and waits for that in ``drain``.
    The exception a collective raises here is an ordinary one, so the forward pass
    unwinds as after any error; no asynchronous exception lands inside it.

    Daemonic, so a call that never returns cannot hold up interpreter exit. Each call
    runs with the caller's ``torch.get_num_threads()``: torch keeps that count per
    thread once a thread has used it, so a later ``set_num_threads`` in the caller's
    thread would otherwise not reach this one.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[PendingCall[Any] | None] = queue.SimpleQueue()
        self._last: PendingCall[Any] | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            call.run()

    def submit(self, fn: Callable[[], T]) -> PendingCall[T]:
        """Run ``fn()`` after the calls already submitted."""
        call = PendingCall(fn, torch.get_num_threads())
        self._last = call
        self._calls.put(call)
        return call

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the last submitted call to end; whether it did."""
        return self._last is None or self._last.wait(timeout_s)

    def stop(self) -> None:
        """End the thread once its calls are done (idempotent)."""
        self._calls.put(None)
