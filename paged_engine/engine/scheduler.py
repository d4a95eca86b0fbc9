"""The scheduler: which sequences run in the next step, and what each one computes.

nano-vllm's policy (seed §3.5) is the baseline, with one structural change:

* **waiting** holds requests without blocks, in arrival order (preempted ones go back to
  the front); **running** holds every request that owns blocks, in admission order.
* A step is either a **prefill** step or a **decode** step. Prefill comes first: running
  sequences whose prompt is only partly computed continue their chunked prefill, then
  waiting requests are admitted from the head through ``can_allocate``/``allocate`` (so
  prefix-cache hits skip work) while the token budget and ``max_num_seqs`` allow. A long
  prompt is split into chunks of at most the remaining budget.
* Otherwise every running sequence decodes one token. When one needs a block and none is
  free, the most recently admitted running sequence is preempted by recompute: its blocks
  are released, ``is_prefill`` is set again, and it goes to the front of waiting.

Prefix-aware admission (also not in nano-vllm): requests admitted in the same step cannot
hit each other's blocks, which are registered only after the step. So a request whose next
uncached block is completed in this step by an earlier request (same position, same
tokens) is deferred to the next step, where it is a prefix hit, and later requests are
admitted in its place; it keeps its place at the front of the queue. A whole batch sharing
a system prompt computes it once instead of once per request.

Policy difference from nano-vllm: a partly prefilled sequence sits in **running** (it owns
blocks), not at the head of waiting. It can therefore be preempted like any other owner
of blocks, so a chunked prompt can never hold blocks that a decoding sequence needs while
nothing is able to run; and since a prefill step always continues it first, every running
sequence is decoding whenever a decode step is scheduled. Results are unchanged: chunking,
prefix hits and preemption only change *when* tokens are computed, never their values.

Costs: scheduling is O(batch) per step plus the allocator's work; the allocator keeps each
sequence's hash chain, so a request retried every step while it waits costs dictionary
look-ups, not hashing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

from paged_engine.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class FailedSample:
    """What a model runner returns, in place of a token, for a sequence it could not
    sample (its logits were not finite): the request finishes with ``finish_reason
    "error"`` and ``reason`` as its ``stop_reason``, and the rest of the batch goes on."""

    reason: str


class Allocator(Protocol):
    """What the scheduler needs from a block manager (the spec's and the engine's)."""

    @property
    def num_free_blocks(self) -> int: ...

    def can_allocate(self, seq: Sequence) -> int | None: ...
    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None: ...
    def can_append(self, seq: Sequence) -> bool: ...
    def may_append(self, seq: Sequence) -> None: ...
    def hash_blocks(self, seq: Sequence) -> None: ...
    def deallocate(self, seq: Sequence) -> None: ...


@dataclass(slots=True)
class SchedulerStats:
    """Counters over the scheduler's lifetime (the engine reports them per run)."""

    prefill_tokens: int = 0
    """Prompt (and recomputed) tokens computed by prefill steps."""
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at each request's first admission."""
    prompt_tokens: int = 0
    preemptions: int = 0
    peak_blocks_in_use: int = 0
    steps: int = 0


class Scheduler:
    """Chooses each step's batch and applies its results (see the module docstring)."""

    def __init__(
        self,
        block_manager: Allocator,
        *,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        prefix_aware: bool = True,
    ) -> None:
        """``eos_token_ids``: every id that ends a request (unless it ignores EOS);
        ``prefix_aware``: defer a request whose next block an earlier request computes in
        the same step (see the module docstring); pass False without prefix caching."""
        self.block_manager = block_manager
        self.prefix_aware = prefix_aware
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ---- choosing a batch ----------------------------------------------------------------

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences, each with ``num_scheduled_tokens`` set, and whether
        it is a prefill step. Raises RuntimeError if nothing can run while work remains
        (a request larger than the pool slipped past validation)."""
        self.stats.steps += 1
        scheduled = self._schedule_prefill()
        if scheduled:
            self._note_blocks_in_use()
            return scheduled, True
        scheduled = self._schedule_decode()
        if not scheduled:
            raise RuntimeError(
                f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.block_manager.num_free_blocks} free blocks"
            )
        self._note_blocks_in_use()
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        filling: set[tuple[int, tuple[int, ...]]] = set()  # blocks this step completes
        for seq in self.running:  # continue chunked prefills first
            if len(scheduled) == self.max_num_seqs or budget == 0:
                return scheduled
            if seq.is_prefill:
                budget -= self._schedule_chunk(seq, budget, filling)
                scheduled.append(seq)
        bm = self.block_manager
        deferred: list[Sequence] = []
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hits = bm.can_allocate(seq)
            if hits is None:
                break
            if filling and hits < seq.num_blocks - 1 and (hits, seq.block(hits)) in filling:
                # Its next block is being computed in this step by an earlier request:
                # next step it is a prefix hit instead of a second computation.
                deferred.append(self.waiting.popleft())
                continue
            bm.allocate(seq, hits)
            self.waiting.popleft()
            if seq.num_prefix_hit_tokens is None:  # first admission
                seq.num_prefix_hit_tokens = seq.num_cached_tokens
                self.stats.cached_prompt_tokens += seq.num_cached_tokens
                self.stats.prompt_tokens += seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            seq.is_prefill = True
            budget -= self._schedule_chunk(seq, budget, filling)
            self.running.append(seq)
            scheduled.append(seq)
        self.waiting.extendleft(reversed(deferred))  # back in front, in arrival order
        return scheduled

    def _schedule_chunk(
        self, seq: Sequence, budget: int, filling: set[tuple[int, tuple[int, ...]]]
    ) -> int:
        """Schedule the next chunk of ``seq``'s prompt within ``budget``; note the blocks
        it completes (by position and tokens) when prefix caching can reuse them."""
        n = min(seq.num_tokens - seq.num_cached_tokens, budget)
        seq.num_scheduled_tokens = n
        if self.prefix_aware:
            bs = seq.block_size
            first = seq.num_cached_tokens // bs
            for j in range(first, (seq.num_cached_tokens + n) // bs):
                filling.add((j, seq.block(j)))
        return n

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        running = self.running
        while running and len(scheduled) < limit:
            seq = running.popleft()
            while not bm.can_append(seq):
                if running:
                    self._preempt(running.pop())  # the most recently admitted
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _note_blocks_in_use(self) -> None:
        in_use = self.num_blocks - self.block_manager.num_free_blocks
        if in_use > self.stats.peak_blocks_in_use:
            self.stats.peak_blocks_in_use = in_use

    # ---- applying a step's results -------------------------------------------------------

    def postprocess(
        self, seqs: list[Sequence], token_ids: Sequence_[int | None], is_prefill: bool
    ) -> list[Sequence]:
        """Register full blocks, advance counters, append sampled tokens, apply stop
        conditions, release finished sequences. Returns the sequences finished now."""
        bm = self.block_manager
        finished: list[Sequence] = []
        for seq, token in zip(seqs, token_ids, strict=True):
            bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            if is_prefill:
                self.stats.prefill_tokens += seq.num_scheduled_tokens
                if seq.num_cached_tokens < seq.num_tokens:
                    continue  # a chunk that did not finish the prompt samples nothing
                seq.is_prefill = False
            else:
                self.stats.decode_tokens += 1
            assert token is not None, "the model runner sampled no token for a finished prompt"
            seq.append_token(token)
            if self._stops(seq, token):
                seq.status = SequenceStatus.FINISHED
                bm.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or seq.num_completion_tokens >= params.max_tokens
            or seq.num_tokens >= self.max_model_len
        )

    def finish_reason(self, seq: Sequence) -> str:
        """ "stop" for EOS or a stop token, "length" for max_tokens or max_model_len."""
        last = seq.last_token
        params = seq.sampling_params
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return "stop"
        return "length"

    # ---- aborting -------------------------------------------------------------------------

    def abort(self, seq: Sequence) -> bool:
        """Remove ``seq`` from whichever queue holds it and free its blocks at once.
        Returns False when it is in neither (already finished or aborted)."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
                if seq.block_table:
                    self.block_manager.deallocate(seq)
                seq.status = SequenceStatus.FINISHED
                return True
        return False
