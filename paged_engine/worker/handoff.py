"""The step hand-off: rank 0 schedules, and each step sends the scheduled
sequences to the other ranks, pickled compactly (``Sequence.__getstate__``: a prefilling
sequence carries its token ids; a decoding one only its counters, ``block_table`` and
``last_token``).

Two transports with one interface, ``send(message)`` on rank 0 and ``receive()`` on the
workers:

* ``ShmChannel`` (the default): the pickle goes into a shared-memory segment
  and one semaphore per worker (``multiprocessing.Semaphore(0)``, released once per
  message) says a step is there. Not a ``multiprocessing.Event``: its ``set()`` waits for
  every sleeping waiter to acknowledge, so a worker killed while it waits would hang
  rank 0 in ``set()`` for ever; a release never waits. A worker waits on its semaphore
  with a timeout and checks that its parent is alive, so an idle worker costs nothing
  and never outlives the engine. No barrier is needed before the next write:
  rank 0 writes step ``k + 1`` only after step ``k``'s collectives, which every worker
  joins only after it has read step ``k``. The segment starts at 1 MiB (nano-vllm's size)
  and is replaced by a larger one when a message does not fit (the old segment then
  carries a ``SegmentMoved`` note).
* ``BroadcastChannel``: ``torch.distributed.broadcast_object_list``, the alternative it is
  measured against. An idle worker waits inside a collective, so it is bound by the
  process group's timeout (``distributed.collective_timeout_s``, a minute by default):
  an engine left idle longer loses its workers (unless it is given ``idle_timeout_s``).
  ``LLM`` uses the shared memory, and this channel only for Ray actors on other nodes
  than rank 0's (``ray_executor.py``), where no memory is shared.

``bench/test_tp_bench.py`` measures both in the engine's step, ``bench/test_tp_costs_bench.py``
alone; the shared-memory channel is kept (figures there and in docs/performance.md,
"Tensor parallelism").
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from typing import Any, cast

import torch.distributed as dist

from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams

INITIAL_SEGMENT_BYTES = 1 << 20
_HEADER = 8  # little-endian payload length
WAIT_POLL_S = 1.0
"""How often an idle worker checks that rank 0 is still alive."""


WORKER_FIELDS = ("prompt_logprobs",)
"""The ``SamplingParams`` fields a worker's forward pass reads (``BatchBuilder.build`` and
``step_logits``: which prompt rows become logits, and how many logprobs each gets).
Every other field is rank 0's alone: it samples, stops and detokenizes."""
_DEFAULTS = SamplingParams()


def _carried(params: SamplingParams) -> tuple[tuple[str, Any], ...]:
    """The ``WORKER_FIELDS`` of ``params`` that differ from the defaults, by comparison
    with the default (never by truth: ``prompt_logprobs=0`` asks for logprobs)."""
    return tuple(
        (name, value)
        for name in WORKER_FIELDS
        if (value := getattr(params, name)) != getattr(_DEFAULTS, name)
    )


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step for the workers. ``params``: ``(index, ((field, value), ...))`` for each
    prefilling sequence whose params set one of ``WORKER_FIELDS``. The sequences'
    sampling params stay behind (workers never sample), but the rows a runner turns into
    logits for prompt logprobs depend on them, and every rank must make the same LM-head
    gathers."""

    seqs: list[Sequence]
    is_prefill: bool
    params: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = ()

    @classmethod
    def of(cls, seqs: list[Sequence], is_prefill: bool) -> StepMessage:
        asked: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = ()
        if is_prefill:
            asked = tuple(
                (i, carried) for i, s in enumerate(seqs) if (carried := _carried(s.sampling_params))
            )
        return cls(seqs, is_prefill, asked)

    def restore(self) -> list[Sequence]:
        """The worker-side sequences, with the carried params put back."""
        for i, carried in self.params:
            self.seqs[i].sampling_params = SamplingParams(**dict(carried))
        return self.seqs


Message = StepMessage | None
"""None tells the workers to exit."""


@dataclass(frozen=True, slots=True)
class SegmentMoved:
    """Written in place of a step message too large for the current segment: the message
    is in the new, larger segment ``name``, which the worker opens and reads from then on."""

    name: str


def encode(message: Message | SegmentMoved) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class ShmChannel:
    """Rank 0's side of the shared-memory hand-off (see the module docstring)."""

    def __init__(self, signals: list[Any], size: int = INITIAL_SEGMENT_BYTES) -> None:
        self.signals = signals
        self.segment = SharedMemory(create=True, size=size)
        self._retired: list[SharedMemory] = []

    @property
    def name(self) -> str:
        return self.segment.name

    def send(self, message: Message) -> None:
        """Write ``message`` and wake every worker."""
        self._drop_retired()  # the workers have read them: a step ran since
        data = encode(message)
        target = self.segment
        if _HEADER + len(data) > target.size:
            bigger = SharedMemory(create=True, size=2 * (_HEADER + len(data)))
            _write(bigger, data)
            data = encode(SegmentMoved(bigger.name))
            self._retired.append(self.segment)
            self.segment = bigger
        _write(target, data)
        for s in self.signals:
            s.release()

    def _drop_retired(self) -> None:
        for seg in self._retired:
            _unlink(seg)
        self._retired.clear()

    def close(self) -> None:
        self._drop_retired()
        _unlink(self.segment)


def _write(segment: SharedMemory, data: bytes) -> None:
    buf = cast(memoryview, segment.buf)
    buf[:_HEADER] = len(data).to_bytes(_HEADER, "little")
    buf[_HEADER : _HEADER + len(data)] = data


def _unlink(segment: SharedMemory) -> None:
    segment.close()
    with contextlib.suppress(FileNotFoundError):  # already gone
        segment.unlink()


class ShmReader:
    """A worker's side of the shared-memory hand-off."""

    def __init__(self, name: str, signal: Any, parent_alive: Callable[[], bool]) -> None:
        self.segment = SharedMemory(name=name)
        self.signal = signal
        self.parent_alive = parent_alive

    def receive(self) -> Message:
        """The next message; None (exit) also when rank 0 has died."""
        while not self.signal.acquire(timeout=WAIT_POLL_S):
            if not self.parent_alive():
                return None
        message = self._read(self.segment)
        if isinstance(message, SegmentMoved):
            self.segment.close()
            self.segment = SharedMemory(name=message.name)
            message = self._read(self.segment)
        return message  # type: ignore[no-any-return]

    @staticmethod
    def _read(segment: SharedMemory) -> Any:
        buf = cast(memoryview, segment.buf)
        n = int.from_bytes(buf[:_HEADER], "little")
        return pickle.loads(buf[_HEADER : _HEADER + n])

    def close(self) -> None:
        self.segment.close()


class BroadcastChannel:
    """Both sides of the ``broadcast_object_list`` hand-off.

    ``idle_timeout_s``: broadcast on a gloo group of its own with this timeout, made at
    the first message (every rank makes it there, in the same order), so that an idle
    worker's wait is bound by it rather than by the collective timeout. Ray's
    hand-off across nodes needs it: an engine left idle for a minute would otherwise
    lose its workers. None: the default group (the benchmark alternative)."""

    def __init__(self, idle_timeout_s: float | None = None) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._group: Any = None

    def _group_for_messages(self) -> Any:
        if self.idle_timeout_s is not None and self._group is None:
            timeout = timedelta(seconds=self.idle_timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def send(self, message: Message) -> None:
        # pickles ``message`` once, itself
        dist.broadcast_object_list([message], src=0, group=self._group_for_messages())

    def receive(self) -> Message:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._group_for_messages())
        return box[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        return None
