"""Deliberately broken schedulers the engine machine must catch."""

from __future__ import annotations

from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence, SequenceStatus


class PreemptWithoutRelease(Scheduler):
    """Preemption requeues the victim but keeps its blocks allocated (a leak)."""

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        seq.block_table.clear()
        seq.num_cached_tokens = 0


class NoHashAfterChunk(Scheduler):
    """Prefill chunks are computed but their full blocks are never registered (R8)."""

    def postprocess(
        self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool
    ) -> list[Sequence]:
        if is_prefill:
            hash_blocks = self.block_manager.hash_blocks
            self.block_manager.hash_blocks = lambda seq: None  # type: ignore[method-assign]
            try:
                return super().postprocess(seqs, token_ids, is_prefill)
            finally:
                self.block_manager.hash_blocks = hash_blocks  # type: ignore[method-assign]
        return super().postprocess(seqs, token_ids, is_prefill)


class AdmitPastTokenBudget(Scheduler):
    """Admission schedules whole prompts, ignoring max_num_batched_tokens."""

    def _schedule_prefill(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        self.max_num_batched_tokens = 1 << 30
        try:
            return super()._schedule_prefill()
        finally:
            self.max_num_batched_tokens = budget


class MaxTokensOffByOne(Scheduler):
    """Stops one token late when max_tokens is reached."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or seq.num_completion_tokens > params.max_tokens
            or seq.num_tokens >= self.max_model_len
        )


class DecodeWithoutGrowth(Scheduler):
    """Decode never calls may_append, so a token that starts a block has no slot (R7)."""

    def _schedule_decode(self) -> list[Sequence]:
        may_append = self.block_manager.may_append
        self.block_manager.may_append = lambda seq: None  # type: ignore[method-assign]
        try:
            return super()._schedule_decode()
        finally:
            self.block_manager.may_append = may_append  # type: ignore[method-assign]


class RecoverKeepsDecodeGrowth(Scheduler):
    """After a failed step, decoding sequences are "restored" by putting them back in
    running as they are: the block ``may_append`` gave them in the failed step is kept."""

    def recover(self) -> list[Sequence]:
        decoding = [s for s in self._in_flight if not s.is_prefill and s.block_table]
        for seq in decoding:
            del self._in_flight[seq]
            seq.num_scheduled_tokens = 0
            if seq not in self.running:
                self.running.append(seq)
        return super().recover()
