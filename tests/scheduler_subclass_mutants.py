"""The subclass scheduler mutants: each overrides one method of the scheduler's parts
(engine/scheduler.py, admission.py, preemption.py) to break one rule of spec/scheduler.py
(S1-S12, docs/design.md), or is one of the policy mutants that survived the suite before
the scheduler spec existed (issue 11). tests/scheduler_mutants.py lists them with the
patch mutants and builds either kind by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Sequence_
from contextlib import contextmanager
from typing import Any

from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.scheduler_state import BlockKey
from paged_engine.engine.sequence import Sequence, SequenceStatus


@contextmanager
def _doing_nothing(allocator: Any, name: str) -> Iterator[None]:
    """``allocator.<name>(seq)`` does nothing inside the block; the method is put back."""
    real = getattr(allocator, name)
    setattr(allocator, name, lambda seq: None)
    try:
        yield
    finally:
        setattr(allocator, name, real)


# ---- hunted by both machines -----------------------------------------------------------


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

    def postprocess(self, seqs: list[Sequence], token_ids: Any) -> list[Sequence]:
        if any(seq.is_prefill for seq in seqs):
            with _doing_nothing(self.block_manager, "hash_blocks"):
                return super().postprocess(seqs, token_ids)
        return super().postprocess(seqs, token_ids)


class AdmitPastTokenBudget(Scheduler):
    """Admission schedules whole prompts, ignoring max_num_batched_tokens."""

    def _schedule_prefill(self, seats: int, budget: int) -> list[Sequence]:
        return super()._schedule_prefill(seats, 1 << 30)


class MaxTokensOffByOne(Scheduler):
    """Stops one token late when max_tokens is reached."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens > params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        )


class DecodeWithoutGrowth(Scheduler):
    """Decode never calls may_append, so a token that starts a block has no slot (R7)."""

    def _schedule_decode(self) -> list[Sequence]:
        with _doing_nothing(self.block_manager, "may_append"):
            return super()._schedule_decode()


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


# ---- the held-out policy mutants of issue 11 ----------------------------------------------


class PromptStatsEveryAdmission(Scheduler):
    """S12: the prompt statistics count every admission, a readmission after preemption
    included (the request's own record, its ``num_prefix_hit_tokens``, stays right)."""

    def _admit(self, seq: Sequence, num_cached_blocks: int, index: int) -> None:
        readmitted = seq.num_prefix_hit_tokens is not None
        super()._admit(seq, num_cached_blocks, index)
        if readmitted:
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
            self.stats.prompt_tokens += seq.num_prompt_tokens


class MaxModelLenOneLate(Scheduler):
    """S9: a sequence stops one token past max_model_len."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.sampling_params
        return (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
            or (params.max_tokens is not None and seq.num_completion_tokens >= params.max_tokens)
            or seq.num_tokens > self.max_model_len
        )


class ChunkFromPrompt(Scheduler):
    """S3: a chunk is sized from the prompt, so a preempted sequence recomputes none of
    its generated tokens (its prefill never completes)."""

    def _schedule_chunk(self, seq: Sequence, budget: int, completing_blocks: set[BlockKey]) -> int:
        prompt_left = seq.num_prompt_tokens - seq.num_cached_tokens
        return super()._schedule_chunk(seq, min(budget, prompt_left), completing_blocks)


# ---- one (or more) per rule of spec/scheduler.py ---------------------------------------


class NewestFirst(Scheduler):
    """S1: a new request joins the front of waiting, not the back."""

    def add(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)


class DecodeBeforePrefill(Scheduler):
    """S2: while any running sequence decodes, nothing prefills."""

    def _schedule_prefill(self, seats: int, budget: int) -> list[Sequence]:
        if any(not s.is_prefill for s in self.running):
            return []
        return super()._schedule_prefill(seats, budget)


class DeferByPosition(Scheduler):
    """S5: blocks told apart by position and tokens, not by the allocator's chain (the
    defect the chain replaced: requests that can never hit each other's blocks wait)."""

    def _block_keys(self, seq: Sequence, first: int, end: int) -> list[BlockKey]:
        return [(j, seq.block(j)) for j in range(first, end)]


class NoDeferral(Scheduler):
    """S5: no request waits for the blocks an earlier one completes in the same step."""

    def _defers(self, seq: Sequence, num_cached_blocks: int, completing: set[BlockKey]) -> bool:
        return False


class DecodePastTokenBudget(Scheduler):
    """S6: a decode step is bounded by max_num_seqs alone, not also by the token budget."""

    def _schedule_decode(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        self.max_num_batched_tokens = 1 << 30
        try:
            return super()._schedule_decode()
        finally:
            self.max_num_batched_tokens = budget


class PreemptedToBack(Scheduler):
    """S7: a preempted sequence goes to the back of waiting, not the front."""

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        self.waiting.popleft()
        self.waiting.append(seq)


class IgnoreEosIgnored(Scheduler):
    """S9: EOS ends a sequence even when its request ignores EOS."""

    def _stops(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_token_ids or super()._stops(seq, token)


class AbortMissesFinished(Scheduler):
    """S10: abort does not reach a finished sequence whose output is undelivered."""

    def abort(self, seq: Sequence) -> bool:
        if seq in self.finished:
            return False
        return super().abort(seq)


class FinishNowKeepsBlocks(Scheduler):
    """S10: a text stop (``finish_now``) ends the sequence but keeps its blocks."""

    def finish_now(self, seq: Sequence) -> None:
        with _doing_nothing(self.block_manager, "deallocate"):
            super().finish_now(seq)


class RecoverToBack(Scheduler):
    """S11: recovered sequences go to the back of waiting, not the front."""

    def recover(self) -> list[Sequence]:
        undone = super().recover()
        for _ in undone:
            self.waiting.popleft()
        self.waiting.extend(undone)
        return undone


class OutputTokensCountFailures(Scheduler):
    """S12: a failed sample counts as an output token (none was appended)."""

    def postprocess(self, seqs: list[Sequence], token_ids: Sequence_[Any]) -> list[Sequence]:
        finished = super().postprocess(seqs, token_ids)
        failed = [s for s, t in zip(seqs, token_ids, strict=True) if isinstance(t, FailedSample)]
        self.stats.output_tokens += sum(s.seq_id in self.errors for s in failed)
        return finished


class FailedStepsNotCounted(Scheduler):
    """S12: a recovered step is not counted in ``failed_steps``."""

    def recover(self) -> list[Sequence]:
        counted = bool(self._in_flight)
        undone = super().recover()
        if counted:
            self.stats.failed_steps -= 1
        return undone


SUBCLASSES: dict[str, type[Scheduler]] = {
    cls.__name__: cls
    for cls in (
        PreemptWithoutRelease,
        NoHashAfterChunk,
        AdmitPastTokenBudget,
        MaxTokensOffByOne,
        DecodeWithoutGrowth,
        RecoverKeepsDecodeGrowth,
        PromptStatsEveryAdmission,
        MaxModelLenOneLate,
        ChunkFromPrompt,
        NewestFirst,
        DecodeBeforePrefill,
        DeferByPosition,
        NoDeferral,
        DecodePastTokenBudget,
        PreemptedToBack,
        IgnoreEosIgnored,
        AbortMissesFinished,
        FinishNowKeepsBlocks,
        RecoverToBack,
        OutputTokensCountFailures,
        FailedStepsNotCounted,
    )
}
