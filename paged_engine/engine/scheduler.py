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
uncached block is completed in this step by an earlier request is deferred to the next
step, where it is a prefix hit, and later requests are admitted in its place; it keeps its
place at the front of the queue. A whole batch sharing a system prompt computes it once
instead of once per request. "The same block" is the allocator's own hit test (R5, R10):
the same chained hash (R4, cache salt included: R4s) and the same tokens. Position and
tokens alone are not enough: requests whose first blocks differ and whose second blocks
agree would defer one another for nothing, since neither can ever hit the other's block.
The chain costs nothing extra with the engine's allocator: it is the one ``can_allocate``
and ``hash_blocks`` compute anyway, cached on the sequence.

Policy difference from nano-vllm: a partly prefilled sequence sits in **running** (it owns
blocks), not at the head of waiting. It can therefore be preempted like any other owner
of blocks, so a chunked prompt can never hold blocks that a decoding sequence needs while
nothing is able to run; and since a prefill step always continues it first, every running
sequence is decoding whenever a decode step is scheduled. Results are unchanged: chunking,
prefix hits and preemption only change *when* tokens are computed, never their values.

**Atomic steps.** If anything raises during a step (the allocator, the model runner, the
sampler, a KeyboardInterrupt), every sequence the step touched is either committed or
preempted, never half done. Before the scheduler changes a sequence (admits it, grows its
table, takes it out of a queue) it records it *in flight* with its token count; the last
statement of its bookkeeping in ``postprocess`` is its commit. ``recover()`` preempts
whatever is still in flight: a token appended without commit is dropped, the blocks are
released (R3) and the sequence goes to the front of waiting, to be recomputed. Results
are unchanged (recomputation is how preemption already works), and the engine keeps
serving.

Why preempt rather than restore the allocator exactly (a journal): the model may already
have written K/V into the step's blocks, and a fresh block taken from the free queue (R2)
lost its old registration. Restoring the old state would re-register a block whose
contents were partly overwritten, so a later prefix hit would read corrupt K/V. Releasing
keeps exactly the registrations whose contents are complete and were not written in this
step (R9: a step writes only to a sequence's own uncomputed slots). Recovery also needs no
inverse operations: only ``deallocate``, which the spec already verifies.

Costs: scheduling is O(batch) per step plus the allocator's work, and one dictionary
insert and delete per scheduled sequence for the in-flight record. The allocator keeps
each sequence's hash chain, so a request retried every step while it waits costs
dictionary look-ups, not hashing. A fault costs the recomputation of the step's sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

from paged_engine.engine.hashing import BlockHasher, salt_block
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.sequence import Sequence, SequenceStatus

BlockKey = tuple[int, object]
"""A full block as the prefix cache tells blocks apart: its chained hash and its tokens."""
Chain = tuple[
    Callable[[Sequence, int], Sequence_[int]], Callable[[Sequence, int], Sequence_[object]]
]
"""The chained hashes, and the tokens, of a sequence's first ``n`` (full) blocks."""


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


def allocator_chain(block_manager: Allocator) -> Chain:
    """The allocator's own hash chain (R4, R4s) and block tokens, which key the deferral.

    The engine's allocator caches both on the sequence (``block_hashes``, ``block_bytes``):
    ``can_allocate`` computed them for every block but the last, and ``hash_blocks`` needs
    the rest after the step, so the deferral adds no hashing. Another allocator (the spec,
    in tests) exposes its block hash as ``hash_fn``; its chain is recomputed from block 0.
    """
    if isinstance(block_manager, BlockHasher):
        return block_manager._block_hashes, block_manager._packed_blocks
    hash_fn: Callable[[tuple[int, ...], int | None], int] | None = getattr(
        block_manager, "hash_fn", None
    )
    if hash_fn is None:
        raise TypeError(
            f"prefix-aware admission needs the allocator's hash chain: "
            f"{type(block_manager).__name__} has no hash_fn (pass prefix_aware=False)"
        )

    def hashes(seq: Sequence, n: int) -> list[int]:
        salt = seq.cache_salt
        h = None if salt is None else hash_fn(tuple(salt_block(salt)), None)
        chain = []
        for i in range(n):
            h = hash_fn(seq.block(i), h)
            chain.append(h)
        return chain

    return hashes, lambda seq, n: [seq.block(i) for i in range(n)]


@dataclass(slots=True)
class SchedulerStats:
    """Counters over the scheduler's lifetime (the engine reports them per run)."""

    prefill_tokens: int = 0
    """Prompt (and recomputed) tokens computed by prefill steps."""
    decode_tokens: int = 0
    output_tokens: int = 0
    """Tokens sampled and appended (a prefill's first token and every decode token)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at each request's first admission."""
    prompt_tokens: int = 0
    preemptions: int = 0
    peak_blocks_in_use: int = 0
    steps: int = 0
    failed_steps: int = 0
    """Steps that raised and were recovered (their sequences preempted)."""


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
        self._chain = allocator_chain(block_manager) if prefix_aware else None
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.finished: list[Sequence] = []
        """Finished sequences whose outputs the engine has not delivered yet."""
        self.errors: dict[int, str] = {}
        """Why each sequence finished with "error" (its sample failed), by seq_id."""
        self.stats = SchedulerStats()
        # Sequences the current step has touched and not committed, with their token
        # counts before the step (see "Atomic steps" in the module docstring).
        self._in_flight: dict[Sequence, int] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        """True when no request waits or runs (outputs may still be undelivered)."""
        return not self.waiting and not self.running

    # ---- choosing a batch ----------------------------------------------------------------

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences, each with ``num_scheduled_tokens`` set, and whether
        it is a prefill step. Raises RuntimeError if nothing can run while work remains
        (a request larger than the pool slipped past validation). If it raises, nothing
        is left half done (``recover()`` has run)."""
        if self._in_flight:
            raise RuntimeError(
                "schedule: the previous step was neither post-processed nor recovered"
            )
        try:
            scheduled = self._schedule_prefill()
            is_prefill = bool(scheduled)
            if not is_prefill:
                scheduled = self._schedule_decode()
            if not scheduled:
                raise RuntimeError(
                    f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} "
                    f"running, {self.block_manager.num_free_blocks} free blocks"
                )
            self._note_blocks_in_use()
            self.stats.steps += 1
        except BaseException:
            self.recover()
            raise
        return scheduled, is_prefill

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        filling: set[BlockKey] = set()  # blocks this step completes
        in_flight = self._in_flight
        for seq in self.running:  # continue chunked prefills first
            if len(scheduled) == self.max_num_seqs or budget == 0:
                return scheduled
            if seq.is_prefill:
                in_flight[seq] = seq.num_tokens
                budget -= self._schedule_chunk(seq, budget, filling)
                scheduled.append(seq)
        bm, waiting, chain = self.block_manager, self.waiting, self._chain
        skipped = 0  # deferred requests stay at the head of waiting, in arrival order
        while skipped < len(waiting) and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = waiting[skipped]
            hits = bm.can_allocate(seq)
            if hits is None:
                break
            if filling and hits < seq.num_blocks - 1 and chain is not None:
                hashes, tokens = chain[0](seq, hits + 1), chain[1](seq, hits + 1)
                if (hashes[hits], tokens[hits]) in filling:
                    # Its next block is being computed in this step by an earlier request:
                    # next step it is a prefix hit instead of a second computation.
                    skipped += 1
                    continue
            in_flight[seq] = seq.num_tokens
            bm.allocate(seq, hits)
            del waiting[skipped]
            if seq.num_prefix_hit_tokens is None:  # first admission
                seq.num_prefix_hit_tokens = seq.num_cached_tokens
                self.stats.cached_prompt_tokens += seq.num_cached_tokens
                self.stats.prompt_tokens += seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            seq.is_prefill = True
            budget -= self._schedule_chunk(seq, budget, filling)
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_chunk(self, seq: Sequence, budget: int, filling: set[BlockKey]) -> int:
        """Schedule the next chunk of ``seq``'s prompt within ``budget``; note the blocks
        it completes (their ``BlockKey``) when prefix caching can reuse them."""
        cached = seq.num_cached_tokens
        n = min(seq.num_tokens - cached, budget)
        seq.num_scheduled_tokens = n
        if self._chain is not None:
            bs = seq.block_size
            first, end = cached // bs, (cached + n) // bs
            if first < end:
                hashes, tokens = self._chain[0](seq, end), self._chain[1](seq, end)
                filling.update(zip(hashes[first:end], tokens[first:end], strict=True))
        return n

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        running, in_flight = self.running, self._in_flight
        while running and len(scheduled) < limit:
            seq = running[0]
            in_flight[seq] = seq.num_tokens
            running.popleft()
            while not bm.can_append(seq):
                if running:
                    victim = running[-1]  # the most recently admitted
                    in_flight[victim] = victim.num_tokens
                    running.pop()
                    self._preempt(victim)
                    del in_flight[victim]
                else:
                    self._preempt(seq)
                    del in_flight[seq]
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Release a sequence that is in no queue and send it to the front of waiting."""
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
        self,
        seqs: list[Sequence],
        token_ids: Sequence_[int | FailedSample | None],
        is_prefill: bool,
    ) -> list[Sequence]:
        """Register full blocks, advance counters, append sampled tokens, apply stop
        conditions, release finished sequences (also kept in ``finished`` until the engine
        delivers them). Returns the sequences finished now. Each sequence commits at the
        end of its own bookkeeping; if this raises, ``recover()`` handles the rest."""
        bm, stats, in_flight = self.block_manager, self.stats, self._in_flight
        finished: list[Sequence] = []
        for seq, token in zip(seqs, token_ids, strict=True):
            bm.hash_blocks(seq)
            n = seq.num_scheduled_tokens
            seq.num_cached_tokens += n
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                stats.prefill_tokens += n  # a chunk that did not finish the prompt
                del in_flight[seq]  # commit
                continue
            if type(token) is int:  # the common case, tested first
                seq.append_token(token)
                stops = self._stops(seq, token)
            elif isinstance(token, FailedSample):
                self.errors[seq.seq_id] = token.reason
                stops = True
            elif isinstance(token, int) and not isinstance(token, bool):  # an int subclass
                seq.append_token(int(token))
                stops = self._stops(seq, int(token))
            else:
                raise RuntimeError(
                    f"the model runner returned {token!r} for {seq}, which samples in this step"
                )
            seq.is_prefill = False
            if stops:
                seq.status = SequenceStatus.FINISHED
                bm.deallocate(seq)
                self.running.remove(seq)
                self.finished.append(seq)
                finished.append(seq)
            if is_prefill:
                stats.prefill_tokens += n
            else:
                stats.decode_tokens += 1
            if not isinstance(token, FailedSample):
                stats.output_tokens += 1
            del in_flight[seq]  # commit
        return finished

    def recover(self) -> list[Sequence]:
        """Preempt every sequence the current step touched and did not commit (see
        "Atomic steps"): drop a token appended without commit, release its blocks, and
        put it at the front of waiting, in the order the step took them. Returns them
        (the step's other sequences committed). Safe to call when nothing is in flight."""
        stale = self._in_flight
        if not stale:
            return []
        self.stats.failed_steps += 1
        # Wherever an interruption left them (a queue, no queue, finished), take them out.
        self.running = deque(s for s in self.running if s not in stale)
        self.waiting = deque(s for s in self.waiting if s not in stale)
        self.finished = [s for s in self.finished if s not in stale]
        for seq, num_tokens in stale.items():
            if seq.block_table:
                self.block_manager.deallocate(seq)
            del seq.token_ids[num_tokens:]
            seq.num_tokens = num_tokens
            seq.last_token = seq.token_ids[-1]
            seq.num_cached_tokens = 0
            seq.num_scheduled_tokens = 0
            seq.is_prefill = True
            seq.status = SequenceStatus.WAITING
            self.errors.pop(seq.seq_id, None)
        undone = list(stale)
        self.waiting.extendleft(reversed(undone))
        self._in_flight = {}
        return undone

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        )

    def finish_reason(self, seq: Sequence) -> str:
        """ "stop" for EOS or a stop token, "length" for max_tokens or max_model_len,
        "error" when its sample failed (``errors`` says why)."""
        if seq.seq_id in self.errors:
            return "error"
        last = seq.last_token
        params = seq.sampling_params
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return "stop"
        return "length"

    def stop_reason(self, seq: Sequence) -> int | str | None:
        """vLLM's ``stop_reason``: the stop token id that ended ``seq`` (None for EOS and
        for length), or the error's description."""
        if seq.seq_id in self.errors:
            return self.errors[seq.seq_id]
        params = seq.sampling_params
        last = seq.last_token
        if not params.ignore_eos and last in self.eos_token_ids:
            return None
        return last if last in params.stop_token_ids else None

    def finish_now(self, seq: Sequence) -> None:
        """End a running sequence between steps (a stop string matched): release its
        blocks; unlike ``abort`` it counts as finished (it is not put in ``finished``:
        the caller reports it)."""
        if seq.block_table:  # first: interrupted, it is still running and may repeat
            self.block_manager.deallocate(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.status = SequenceStatus.FINISHED

    # ---- aborting -------------------------------------------------------------------------

    def abort(self, seq: Sequence) -> bool:
        """Remove ``seq`` from whichever queue holds it (finished but undelivered
        included) and free its blocks at once. Returns False when it is in none."""
        for queue in (self.waiting, self.running, self.finished):
            if seq in queue:
                if seq.block_table:
                    self.block_manager.deallocate(seq)
                queue.remove(seq)
                seq.status = SequenceStatus.FINISHED
                self.errors.pop(seq.seq_id, None)
                return True
        return False
