"""Deliberately broken allocators, each named after the rule it breaks.

Each is the engine's ``BlockManager`` with one small override. tests/test_mutants.py runs
the lockstep machine (not a hand-written example) against each and requires it to fail:
proof that the machine can catch that class of bug.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from typing import Any

from paged_engine.engine.block_manager import BlockManager, xxh64_block_hash
from paged_engine.engine.sequence import Sequence


class R2NoDeleteStaleHash(BlockManager):
    """Reusing a block leaves its old hash registered (the stale entry of nano-vllm #163)."""

    def _fresh_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        self.block_hashes[block] = None
        self.block_tokens[block] = ()
        self.ref_counts[block] = 1
        return block


class R2UnguardedDelete(BlockManager):
    """Reusing a block deletes its old hash's entry even when it points to another block."""

    def _fresh_block(self) -> int:
        old = self.block_hashes[next(iter(self.free_blocks))]
        if old is not None:
            self.hash_to_block.pop(old, None)
        return super()._fresh_block()


class R5LookupLastBlock(BlockManager):
    """The lookup also tries the last block, so a fully cached prompt computes nothing."""

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        full = seq.num_tokens // self.block_size  # the last block, when it is full
        return super()._lookup(seq, full)


class R3ForwardRelease(BlockManager):
    """Release walks the table first to last, so shared prefixes are evicted first."""

    def deallocate(self, seq: Sequence) -> None:
        seq.block_table.reverse()  # the real release walks backwards: undo that
        super().deallocate(seq)


class R1LifoReuse(BlockManager):
    """Fresh blocks come from the tail: the most recently freed (most useful) goes first."""

    def _fresh_block(self) -> int:
        self.free_blocks.move_to_end(next(reversed(self.free_blocks)), last=False)
        return super()._fresh_block()


class R6ReviveWithoutRemoval(BlockManager):
    """A hit in the free queue gets ref_count 1 but stays queued, to be handed out again."""

    def _take_hit(self, block: int) -> None:
        if self.ref_counts[block]:
            self.ref_counts[block] += 1
        else:
            self.ref_counts[block] = 1


class R6NoSharedIncrement(BlockManager):
    """A hit on a block in use is attached without counting the new holder."""

    def _take_hit(self, block: int) -> None:
        if not self.ref_counts[block]:
            super()._take_hit(block)


class R4NoPrefixChain(BlockManager):
    """Each block is hashed alone: equal blocks after different prefixes collide."""

    def __init__(self, num_blocks: int, block_size: int, **kwargs: Any) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self._hash_fn = lambda tokens, prefix: xxh64_block_hash(tokens, None)


class R10NoTokenVerification(BlockManager):
    """A hash hit is trusted without comparing tokens; caught with a colliding hash."""

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        hits = []
        for i in range(num_candidates):
            block = self.hash_to_block.get(self._block_hashes(seq, i + 1)[i])
            if block is None:
                break
            hits.append(block)
        return hits


class R7ModOneGrowth(BlockManager):
    """nano-vllm's ``len % bs == 1`` growth rule: never true when block_size == 1."""

    def _starts_block(self, seq: Sequence) -> bool:
        return len(seq) % self.block_size == 1

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_blocks) >= self._starts_block(seq)

    def may_append(self, seq: Sequence) -> None:
        if self._starts_block(seq):
            if not self.free_blocks:
                raise RuntimeError("may_append: no free block")
            self._state_changed()
            seq.block_table.append(self._fresh_block())


def colliding_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """Eight hash values in all: different blocks collide constantly, so the token check
    (R10) decides most lookups."""
    return xxh64_block_hash(token_ids, prefix) % 8


class R4sSaltIgnored(BlockManager):
    """The cache salt is dropped: requests under different salts (tenants) share blocks."""

    def _chain_start(self, seq: Sequence) -> int | None:
        return None


class R13KeepsBlockHashes(BlockManager):
    """The reset empties the hash map but leaves each block's hash and tokens behind."""

    def reset_prefix_cache(self) -> bool:
        hashes, tokens = list(self.block_hashes), list(self.block_tokens)
        reset = super().reset_prefix_cache()
        self.block_hashes[:], self.block_tokens[:] = hashes, tokens
        return reset


class R13ResetWhileInUse(BlockManager):
    """The reset goes ahead while sequences hold blocks (vLLM refuses while requests run)."""

    def reset_prefix_cache(self) -> bool:
        free = self.free_blocks
        self.free_blocks = OrderedDict.fromkeys(range(self.num_blocks))  # all look free
        try:
            return super().reset_prefix_cache()
        finally:
            self.free_blocks = free


class R13KeepsRememberedLookup(BlockManager):
    """The reset leaves the state version alone, so a lookup remembered from before it
    (``can_allocate``'s memo) still counts hits on blocks that no longer hold anything."""

    def reset_prefix_cache(self) -> bool:
        version = self._version
        reset = super().reset_prefix_cache()
        self._version = version
        return reset
