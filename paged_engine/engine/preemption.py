"""The decode step, and preemption by recompute when a growing sequence finds no block.

In a decode step every running sequence, from the front, computes its newest token (S6),
up to ``min(max_num_seqs, max_num_batched_tokens)`` of them; each may need a block for
it (R7). When one does and none is free, the most recently admitted running sequence not
yet scheduled is preempted (S7), else the sequence itself: its blocks are released (R3),
``is_prefill`` is set again, and it goes to the front of waiting, its tokens kept, to be
recomputed by a later prefill (S3). Preemption never changes a token's value, only when
it is computed.

Since a prefill step always continues a partly prefilled sequence first, every running
sequence is decoding whenever a decode step is scheduled. Rule numbers refer to
docs/design.md.
"""

from __future__ import annotations

from paged_engine.engine.scheduler_state import SchedulerState
from paged_engine.engine.sequence import Sequence, SequenceStatus


class DecodeWithPreemption(SchedulerState):
    """The scheduler's decode step (S6, S7): a base class of ``Scheduler``."""

    def _schedule_decode(self) -> list[Sequence]:
        """The decode step's batch, each with ``num_scheduled_tokens`` 1, at the front
        of running in the same order; the preempted at the front of waiting."""
        block_manager = self.block_manager
        max_batch = min(self.max_num_seqs, self.max_num_batched_tokens)
        batch: list[Sequence] = []
        running, in_flight = self.running, self._in_flight
        # S2m: running's decoding sequences are its head (a chunk continues before any
        # later one, so no sequence finishes its prefill before an earlier one): a mixed
        # step's decodes end at the first chunked prefill, which is left to its chunk.
        while running and len(batch) < max_batch and not running[0].is_prefill:
            seq = running[0]
            in_flight[seq] = seq.num_tokens
            running.popleft()
            while not block_manager.can_append(seq):
                if running:
                    victim = running[-1]  # S7: the most recently admitted
                    in_flight[victim] = victim.num_tokens
                    running.pop()
                    self._preempt(victim)
                    del in_flight[victim]
                else:
                    self._preempt(seq)
                    del in_flight[seq]
                    break
            else:
                block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        running.extendleft(reversed(batch))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """S7: release a sequence that is in no queue (R3) and send it to the front of
        waiting."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
