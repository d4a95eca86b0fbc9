"""The scheduler: which sequences run in the next step, what each computes, and what the
step's results do to them.

nano-vllm's policy is the baseline. ``waiting`` holds requests without blocks, in arrival
order; ``running`` every request that holds blocks, in admission order (S1). A step is a
prefill step if anything can prefill (S2), else a decode step:

* admission.py: the prefill step. Chunked prefills continue first (S3), then waiting
  requests are admitted from the head (S4), a request deferred when an earlier one
  completes its next block in the same step (S5, prefix-aware admission: not in
  nano-vllm); long prompts are chunked to the token budget.
* preemption.py: the decode step. Every running sequence decodes one token (S6); one that
  needs a block when none is free preempts the newest running sequence by recompute (S7).
* Here: the step as a whole (``schedule``), its results (``postprocess``: S8, S9), ending
  a sequence between steps (``finish_now``, ``abort``: S10), recovery (``recover``: S11),
  and the statistics (S12). The state all of them share is ``SchedulerState``
  (scheduler_state.py).

Policy difference from nano-vllm: a partly prefilled sequence sits in running (it holds
blocks), not at the head of waiting. It can therefore be preempted like any other holder
of blocks, so a chunked prompt can never hold blocks that a decoding sequence needs while
nothing is able to run. Results are unchanged: chunking, prefix hits and preemption only
change *when* tokens are computed, never their values.

Atomic steps (docs/design.md, "Atomic steps"). If anything raises during a step (the
allocator, the model runner, the sampler, a KeyboardInterrupt), every sequence the step
touched is either committed or preempted, never half done. Before the scheduler changes a
sequence (admits it, grows its table, takes it out of a queue) it records it *in flight*
with its token count; the last statement of its bookkeeping in ``postprocess`` is its
commit. ``recover()`` preempts whatever is still in flight: a token appended without
commit is dropped, the blocks are released (R3) and the sequence goes to the front of
waiting, to be recomputed. Results are unchanged (recomputation is how preemption already
works), and the engine keeps serving.

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

Rule numbers refer to docs/design.md; spec/scheduler.py states S1-S12 as code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Sequence_

from paged_engine.engine.admission import PrefillAdmission
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.preemption import DecodeWithPreemption
from paged_engine.engine.scheduler_state import Allocator, SchedulerStats
from paged_engine.engine.sequence import Sequence, SequenceStatus

__all__ = ["Allocator", "Scheduler", "SchedulerStats"]


class Scheduler(PrefillAdmission, DecodeWithPreemption):
    """Chooses each step's batch and applies its results (see the module docstring).

    Built as ``Scheduler(block_manager, num_blocks=..., max_num_seqs=...,
    max_num_batched_tokens=..., max_model_len=..., eos_token_ids=..., prefix_aware=...)``:
    ``SchedulerState.__init__`` says what each argument and attribute is for.
    """

    def add(self, seq: Sequence) -> None:
        """S1: a new sequence joins the back of waiting."""
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        """True when no request waits or runs (outputs may still be undelivered)."""
        return not self.waiting and not self.running

    # ---- choosing a batch ----------------------------------------------------------------

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences, each with ``num_scheduled_tokens`` set, and whether
        it is a prefill step (S2). Raises RuntimeError if nothing can run while work
        remains (a request larger than the pool slipped past validation). If it raises,
        nothing is left half done (``recover()`` has run)."""
        if self._in_flight:
            raise RuntimeError(
                "schedule: the previous step was neither post-processed nor recovered"
            )
        try:
            if self.mixed_steps:  # S2m: the decodes first, then chunks in what is left
                batch = self._schedule_decode()
                seats, budget = self.max_num_seqs - len(batch), self.max_num_batched_tokens
                prefills = self._schedule_prefill(seats, budget - len(batch))
                batch += prefills
                is_prefill = bool(prefills)
            else:
                batch = self._schedule_prefill(self.max_num_seqs, self.max_num_batched_tokens)
                is_prefill = bool(batch)
                if not is_prefill:
                    batch = self._schedule_decode()
            if not batch:
                raise RuntimeError(
                    f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} "
                    f"running, {self.block_manager.num_free_blocks} free blocks"
                )
            self._note_blocks_in_use()
            self.stats.steps += 1
        except BaseException:
            self.recover()
            raise
        return batch, is_prefill

    def _note_blocks_in_use(self) -> None:
        """S12: the peak of blocks in use, after each scheduled step."""
        in_use = self.num_blocks - self.block_manager.num_free_blocks
        if in_use > self.stats.peak_blocks_in_use:
            self.stats.peak_blocks_in_use = in_use

    # ---- applying a step's results -------------------------------------------------------

    def postprocess(
        self,
        seqs: list[Sequence],
        token_ids: Sequence_[int | FailedSample | None],
    ) -> list[Sequence]:
        """S8: register full blocks (R8), advance counters, append sampled tokens; S9:
        apply stop conditions, release finished sequences (also kept in ``finished``
        until the engine delivers them). Returns the sequences finished now. Each
        sequence commits at the end of its own bookkeeping; if this raises,
        ``recover()`` handles the rest."""
        block_manager, stats, in_flight = self.block_manager, self.stats, self._in_flight
        finished: list[Sequence] = []
        for seq, token in zip(seqs, token_ids, strict=True):
            block_manager.hash_blocks(seq)
            computed = seq.num_scheduled_tokens
            seq.num_cached_tokens += computed
            prefill_row = seq.is_prefill  # S2m: a step may hold both kinds of row
            if prefill_row and seq.num_cached_tokens < seq.num_tokens:
                stats.prefill_tokens += computed  # S8: a chunk that samples nothing
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
                block_manager.deallocate(seq)
                self.running.remove(seq)
                self.finished.append(seq)
                finished.append(seq)
            if prefill_row:
                stats.prefill_tokens += computed
            else:
                stats.decode_tokens += 1
            if not isinstance(token, FailedSample):
                stats.output_tokens += 1
            del in_flight[seq]  # commit
        return finished

    def _stops(self, seq: Sequence, token: int) -> bool:
        """S9, after ``token`` is appended to ``seq``."""
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        )

    def finish_reason(self, seq: Sequence) -> str:
        """S9: "stop" for EOS or a stop token, "length" for max_tokens or max_model_len,
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

    # ---- a step that raised ---------------------------------------------------------------

    def recover(self) -> list[Sequence]:
        """S11: preempt every sequence the current step touched and did not commit (see
        "Atomic steps"): drop a token appended without commit, release its blocks, and
        put it at the front of waiting, in the order the step took them. Returns them
        (the step's other sequences committed). Safe to call when nothing is in flight."""
        interrupted = self._in_flight
        if not interrupted:
            return []
        self.stats.failed_steps += 1
        # Wherever an interruption left them (a queue, no queue, finished), take them out.
        self.running = deque(s for s in self.running if s not in interrupted)
        self.waiting = deque(s for s in self.waiting if s not in interrupted)
        self.finished = [s for s in self.finished if s not in interrupted]
        for seq, num_tokens in interrupted.items():
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
        undone = list(interrupted)
        self.waiting.extendleft(reversed(undone))
        self._in_flight = {}
        return undone

    # ---- ending a sequence between steps (S10) -------------------------------------------

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
