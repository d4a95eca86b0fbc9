"""The prefill step: chunked prefills continue, then waiting requests are admitted.

A prefill step first continues the chunked prefills in running (S3), then admits waiting
requests from the head (S4) through ``can_allocate``/``allocate``, so that prefix-cache
hits skip work, while the token budget and ``max_num_seqs`` allow. A request that does
not fit stops admission: no later request overtakes it. Each sequence computes the rest
of its context (prompt, and any generated tokens a preemption left to recompute), cut
to the budget that remains: a long prompt is split into chunks over several steps.

Prefix-aware admission (S5, not in nano-vllm): requests admitted in the same step cannot
hit each other's blocks, which are registered only after the step. So a request whose
next uncached block is completed in this step by an earlier request is deferred to the
next step, where it is a prefix hit, and later requests are admitted in its place; it
keeps its place at the front of the queue. A whole batch sharing a system prompt computes
it once instead of once per request. "The same block" is the allocator's own hit test
(R5, R10): the same chained hash (R4, cache salt included: R4s) and the same tokens.
Position and tokens alone are not enough: requests whose first blocks differ and whose
second blocks agree would defer one another for nothing, since neither can ever hit the
other's block. The chain costs nothing extra with the engine's allocator: it is the one
``can_allocate`` and ``hash_blocks`` compute anyway, cached on the sequence.

Rule numbers refer to docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from paged_engine.engine.scheduler_state import BlockKey, Chain, SchedulerState
from paged_engine.engine.sequence import Sequence, SequenceStatus


class PrefillAdmission(SchedulerState):
    """The scheduler's prefill step (S3, S4, S5): a base class of ``Scheduler``."""

    def _schedule_prefill(self, seats: int, budget: int) -> list[Sequence]:
        """The prefill step's batch (or a mixed step's chunks: S2m) within ``seats``
        sequences and ``budget`` tokens, each with ``num_scheduled_tokens`` set; empty
        when nothing can prefill (the step then decodes)."""
        batch: list[Sequence] = []
        completing_blocks: set[BlockKey] = set()  # what a waiting request may wait for (S5)
        in_flight = self._in_flight
        for seq in self.running:  # S3: chunked prefills continue first, in running order
            if len(batch) >= seats or budget <= 0:
                return batch
            if seq.is_prefill:
                in_flight[seq] = seq.num_tokens
                budget -= self._schedule_chunk(seq, budget, completing_blocks)
                batch.append(seq)
        waiting = self.waiting
        num_deferred = 0  # S5: deferred requests stay at the head of waiting, in order
        while num_deferred < len(waiting) and len(batch) < seats and budget > 0:
            seq = waiting[num_deferred]
            num_cached_blocks = self.block_manager.can_allocate(seq)
            if num_cached_blocks is None:
                break  # S4: no request overtakes one that does not fit
            if completing_blocks and self._defers(seq, num_cached_blocks, completing_blocks):
                num_deferred += 1
                continue
            self._admit(seq, num_cached_blocks, num_deferred)
            budget -= self._schedule_chunk(seq, budget, completing_blocks)
            batch.append(seq)
        return batch

    def _admit(self, seq: Sequence, num_cached_blocks: int, index: int) -> None:
        """Move ``seq``, ``waiting[index]``, to the back of running: its blocks (its
        ``num_cached_blocks`` prefix hits first, R6), its first admission's statistics
        (S12). It is in flight before anything changes."""
        self._in_flight[seq] = seq.num_tokens
        self.block_manager.allocate(seq, num_cached_blocks)
        del self.waiting[index]
        if seq.num_prefix_hit_tokens is None:  # S12: the first admission only
            seq.num_prefix_hit_tokens = seq.num_cached_tokens
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
            self.stats.prompt_tokens += seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        seq.is_prefill = True
        self.running.append(seq)

    def _defers(
        self, seq: Sequence, num_cached_blocks: int, completing_blocks: set[BlockKey]
    ) -> bool:
        """S5: whether the first block of ``seq`` past its prefix hits is one this step
        completes (next step, it is a hit instead of a second computation). Its last
        block never defers it: the prefix cache never serves a sequence's last block
        (R5), so waiting for it would gain nothing."""
        if num_cached_blocks >= seq.num_blocks - 1 or self._hash_chain is None:
            return False
        next_block = self._block_keys(seq, num_cached_blocks, num_cached_blocks + 1)
        return not completing_blocks.isdisjoint(next_block)

    def _schedule_chunk(self, seq: Sequence, budget: int, completing_blocks: set[BlockKey]) -> int:
        """S3: schedule the rest of ``seq``'s context, cut to ``budget``; note the blocks
        it completes in ``completing_blocks`` when prefix-aware (S5). Returns its size."""
        cached = seq.num_cached_tokens
        size = min(seq.num_tokens - cached, budget)
        seq.num_scheduled_tokens = size
        if self._hash_chain is not None:
            bs = seq.block_size
            first, end = cached // bs, (cached + size) // bs
            if first < end:
                completing_blocks.update(self._block_keys(seq, first, end))
        return size

    def _block_keys(self, seq: Sequence, first: int, end: int) -> Iterable[BlockKey]:
        """Full blocks ``first`` to ``end - 1`` of ``seq`` as the prefix cache tells them
        apart (R5, R10): the allocator's chained hash (R4, R4s) and the tokens. Only
        called when prefix-aware."""
        hashes, tokens = cast(Chain, self._hash_chain)
        return zip(hashes(seq, end)[first:end], tokens(seq, end)[first:end], strict=True)
