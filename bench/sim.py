"""A nano-vllm-shaped scheduling loop over a trace, with the allocator injected.

The same code drives the spec and the engine, so any difference in the timings is the
allocators' (and their sequence types'). The model is fake: a step "computes" the
scheduled tokens instantly and "samples" the request's next scripted token.

Each step follows nano-vllm's scheduler (docs/design.md, "Scheduler rules"):

* **Prefill first.** Admit from the head of the waiting queue while ``can_allocate``
  says yes, the step has token budget left and fewer than ``max_num_seqs`` are batched;
  ``allocate`` with the returned hits. A prompt longer than the budget left is *chunked*:
  it computes what fits and stays at the head of the waiting queue holding its blocks,
  continuing next step without a new lookup. A step that prefilled anything does not
  decode (nano-vllm's rule).
* **Otherwise decode** every running sequence (up to ``max_num_seqs``), oldest first:
  while ``can_append`` says no, preempt the most recently admitted running sequence
  (``deallocate``, back to the *front* of the waiting queue, prefill again; if none is
  left but the sequence itself, preempt it), then ``may_append``.
* **Postprocess** the batch after the whole step is scheduled, as a real engine does
  after the forward pass: set ``num_scheduled_tokens``, ``hash_blocks`` (R8), advance
  ``num_cached_tokens``; a sequence whose prompt is now complete, or that decoded,
  appends its next scripted token; one that has produced its whole script is finished
  and deallocated. Registering after scheduling matters: requests admitted in the same
  step cannot hit each other's blocks, exactly as in nano-vllm.

A wave of the trace arrives when the previous one has drained (see ``bench.traces``).

One *sequence-step* is one sequence scheduled in one step (prefill chunk or decode); the
benchmarks divide wall time by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from bench.traces import Trace

__all__ = [
    "Allocator",
    "Request",
    "SimSequence",
    "Stats",
    "materialize",
    "run_trace",
    "run_waves",
]


class SimSequence(Protocol):
    """What the loop needs of a sequence (both ``Sequence`` types provide it)."""

    block_table: list[int]
    num_cached_tokens: int
    num_scheduled_tokens: int
    is_prefill: bool

    def __len__(self) -> int: ...

    def append_token(self, token_id: int) -> None: ...


class Allocator(Protocol):
    """The allocator API under test (docs/design.md, "Allocator rules")."""

    def can_allocate(self, seq: SimSequence, /) -> int | None: ...

    def allocate(self, seq: SimSequence, num_cached_blocks: int, /) -> None: ...

    def can_append(self, seq: SimSequence, /) -> bool: ...

    def may_append(self, seq: SimSequence, /) -> None: ...

    def hash_blocks(self, seq: SimSequence, /) -> None: ...

    def deallocate(self, seq: SimSequence, /) -> None: ...


MakeAllocator = Callable[[int, int], Allocator]
"""``make_bm(num_blocks, block_size)``."""
MakeSequence = Callable[[list[int], int], SimSequence]
"""``make_seq(token_ids, block_size)``."""


class Request:
    """A sequence plus what the fake model will sample for it, and how much is left."""

    __slots__ = ("left", "outputs", "seq")

    def __init__(self, seq: SimSequence, output: Sequence[int]) -> None:
        self.seq = seq
        self.outputs: Iterator[int] = iter(output)
        self.left = len(output)


@dataclass(frozen=True, slots=True)
class Stats:
    """What a run did; equal for two allocators that behave identically.

    ``prefill_tokens`` counts the tokens of every sequence at admission (re-admissions
    after preemption included) and ``hit_tokens`` those the prefix cache served, so
    ``hit_rate`` is the share of prefill work the cache saved. ``final_tables`` holds the
    block tables of the sequences still holding blocks when the run stopped (running
    queue first, then waiting), empty after a complete run.
    """

    steps: int
    seq_steps: int
    prefill_seq_steps: int
    decode_seq_steps: int
    preemptions: int
    finished: int
    prefill_tokens: int
    hit_tokens: int
    final_tables: tuple[tuple[int, ...], ...]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prefill_tokens if self.prefill_tokens else 0.0


def materialize(trace: Trace, make_seq: MakeSequence, block_size: int) -> list[list[Request]]:
    """Build the trace's sequences, wave by wave.

    Kept apart from ``run_waves`` so that benchmarks build them outside the timed region:
    constructing a sequence is not allocator work, and the engine's ``Sequence`` validates
    every token, which would add a per-prompt cost unrelated to the allocator.
    """
    return [
        [Request(make_seq(list(r.prompt), block_size), r.output) for r in wave] for wave in trace
    ]


def run_waves(
    waves: list[list[Request]],
    bm: Allocator,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_steps: int | None = None,
) -> Stats:
    """Run the scheduling loop over prebuilt waves until drained (or ``max_steps``).

    The body binds everything it calls to locals: its own overhead is charged to both
    allocators alike, so it is kept as small as the loop's shape allows.
    """
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    can_allocate, allocate = bm.can_allocate, bm.allocate
    can_append, may_append = bm.can_append, bm.may_append
    hash_blocks, deallocate = bm.hash_blocks, bm.deallocate
    waiting: deque[Request] = deque()
    running: deque[Request] = deque()
    pending = iter(waves)
    steps = prefill_seq_steps = decode_seq_steps = 0
    preemptions = finished = prefill_tokens = hit_tokens = 0

    while max_steps is None or steps < max_steps:
        if not waiting and not running:
            wave = next(pending, None)
            if wave is None:
                break
            waiting.extend(wave)
        steps += 1
        batch: list[Request] = []

        # Prefill: admit from the head while blocks, budget and batch slots last.
        budget = max_num_batched_tokens
        while waiting and budget and len(batch) < max_num_seqs:
            req = waiting[0]
            seq = req.seq
            if not seq.block_table:  # not a chunked prefill carried over from last step
                hits = can_allocate(seq)
                if hits is None:
                    break
                allocate(seq, hits)
                prefill_tokens += len(seq)
                hit_tokens += seq.num_cached_tokens
            todo = len(seq) - seq.num_cached_tokens
            if todo > budget:
                todo = budget  # chunk: stays at the head, keeps its blocks
            else:
                waiting.popleft()
                running.append(req)
            seq.num_scheduled_tokens = todo
            budget -= todo
            batch.append(req)

        if batch:
            prefill_seq_steps += len(batch)
            for req in batch:
                seq = req.seq
                hash_blocks(seq)
                seq.num_cached_tokens += seq.num_scheduled_tokens
                if seq.num_cached_tokens == len(seq):  # prompt complete: sample
                    seq.is_prefill = False
                    seq.append_token(next(req.outputs))
                    req.left -= 1
                    if not req.left:
                        deallocate(seq)
                        running.remove(req)
                        finished += 1
            continue

        # Decode: every running sequence, preempting the newest when no block is free.
        while running and len(batch) < max_num_seqs:
            req = running.popleft()
            seq = req.seq
            while not can_append(seq):
                victim = running.pop() if running else req
                deallocate(victim.seq)
                victim.seq.is_prefill = True
                waiting.appendleft(victim)
                preemptions += 1
                if victim is req:
                    break
            else:
                may_append(seq)
                batch.append(req)
        if not batch:
            raise RuntimeError(
                f"step {steps}: nothing could be scheduled; the pool is too small for the "
                "request at the head of the waiting queue"
            )
        running.extendleft(reversed(batch))
        decode_seq_steps += len(batch)
        for req in batch:
            seq = req.seq
            seq.num_scheduled_tokens = 1
            hash_blocks(seq)
            seq.num_cached_tokens += 1
            seq.append_token(next(req.outputs))
            req.left -= 1
            if not req.left:
                deallocate(seq)
                running.remove(req)
                finished += 1

    holders = [r.seq for r in running] + [r.seq for r in waiting if r.seq.block_table]
    return Stats(
        steps=steps,
        seq_steps=prefill_seq_steps + decode_seq_steps,
        prefill_seq_steps=prefill_seq_steps,
        decode_seq_steps=decode_seq_steps,
        preemptions=preemptions,
        finished=finished,
        prefill_tokens=prefill_tokens,
        hit_tokens=hit_tokens,
        final_tables=tuple(tuple(s.block_table) for s in holders),
    )


def run_trace(
    trace: Trace,
    make_bm: MakeAllocator,
    make_seq: MakeSequence,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    *,
    max_steps: int | None = None,
) -> Stats:
    """Build a fresh allocator and fresh sequences, then run the whole trace."""
    return run_waves(
        materialize(trace, make_seq, block_size),
        make_bm(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_steps=max_steps,
    )
