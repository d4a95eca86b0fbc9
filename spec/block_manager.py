"""Reference model of the block allocator: the simplest code that states rules R1-R13
(and R4s, the cache salt).

Each step cites the rule it implements. Speed is no concern here (lists, linear scans, the
hash chain recomputed from the first block every time); ``paged_engine.engine.block_manager``
is the fast twin, and the tests drive both in lockstep. Its snapshot is its own record
(spec/records.py), compared with the engine's field by field. Contracts are PEP 316
docstrings, checked by CrossHair.
"""

from __future__ import annotations

from spec.hashing import HashFn, salt_block, sha256_block_hash, simple_block_hash, xxh64_block_hash
from spec.indexing import needs_new_block
from spec.records import SpecAllocatorState
from spec.sequence import SpecSequence

__all__ = ["BlockManager", "HashFn", "sha256_block_hash", "simple_block_hash", "xxh64_block_hash"]


class BlockManager:
    """Blocks ``0..N-1`` with ref counts, hashes, tokens, one FIFO free queue (R1).

    inv: sorted(self.free_queue + self.used_blocks()) == list(range(self.num_blocks))
    inv: all((self.ref_counts[b] == 0) == (b in self.free_queue) for b in range(self.num_blocks))
    inv: all(0 <= b < self.num_blocks and self.block_hashes[b] == h for h, b in self.hash_to_block.items())
    inv: all(self.block_hashes[b] is not None and len(self.block_tokens[b]) == self.block_size for b in range(self.num_blocks) if self.ref_counts[b] > 1)
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = xxh64_block_hash):
        """Raises ValueError for an empty pool or block size (the pre: lines below).

        ``hash_fn`` is R4's block hash: ``xxh64_block_hash``, ``sha256_block_hash`` (the
        engine's ``hash_algorithm="sha256"``), or a test's. It also hashes R4s's salt block.

        pre: num_blocks >= 1
        pre: block_size >= 1
        post: self.free_queue == list(range(num_blocks))
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue = list(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def used_blocks(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self.ref_counts[b] > 0]

    @staticmethod
    def compute_hash(token_ids: tuple[int, ...] | list[int], prefix: int | None = None) -> int:
        """R4, with the default hash function."""
        return xxh64_block_hash(tuple(token_ids), prefix)

    def _chain_start(self, seq: SpecSequence) -> int | None:
        """R4s: block 0's prefix: None without a salt, else the hash of the salt block."""
        if seq.cache_salt is None:
            return None
        return self.hash_fn(salt_block(seq.cache_salt), None)

    def _fresh_block(self) -> int:
        """R2: the head of the free queue, its stale registration dropped, reset."""
        block = self.free_queue.pop(0)
        old = self.block_hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.ref_counts[block] = 1
        self.block_hashes[block] = None
        self.block_tokens[block] = ()
        return block

    def _lookup(self, seq: SpecSequence) -> list[int]:
        """R5, R10: blocks holding the sequence's leading full blocks, never the last one."""
        if seq.block_size != self.block_size:
            raise ValueError(
                f"the sequence's block_size {seq.block_size} != the allocator's {self.block_size}"
            )
        hits: list[int] = []
        h = self._chain_start(seq)
        for i in range(seq.num_blocks - 1):
            tokens = seq.block(i)
            h = self.hash_fn(tokens, h)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def _blocks_needed(self, seq: SpecSequence, hits: list[int]) -> int:
        """R5: every block but the hits in use comes out of the free queue."""
        return seq.num_blocks - sum(1 for b in hits if self.ref_counts[b] > 0)

    def can_allocate(self, seq: SpecSequence) -> int | None:
        """R5: the number of prefix-cache hits, or None when the free queue is too short.

        pre: len(seq.token_ids) >= 1
        pre: seq.block_size == self.block_size
        post: __return__ is None or 0 <= __return__ < seq.num_blocks
        """
        hits = self._lookup(seq)
        if self.num_free_blocks < self._blocks_needed(seq, hits):
            return None
        return len(hits)

    def allocate(self, seq: SpecSequence, num_cached_blocks: int) -> None:
        """R6: share the hits in use, revive the hits in the free queue, then fresh blocks.

        pre: len(seq.token_ids) >= 1
        pre: seq.block_size == self.block_size
        raises: ValueError, RuntimeError
        post: len(seq.block_table) == seq.num_blocks
        post: seq.num_cached_tokens == num_cached_blocks * self.block_size
        """
        if seq.block_table:
            raise RuntimeError("allocate: the sequence already holds blocks")
        hits = self._lookup(seq)
        if num_cached_blocks != len(hits):
            raise ValueError(
                f"allocate: num_cached_blocks={num_cached_blocks}, but the prefix cache "
                f"holds {len(hits)} leading blocks of this sequence"
            )
        if self.num_free_blocks < self._blocks_needed(seq, hits):
            raise RuntimeError("allocate: not enough free blocks for this sequence")
        for block in hits:
            if self.ref_counts[block] > 0:
                self.ref_counts[block] += 1
            else:
                self.free_queue.remove(block)
                self.ref_counts[block] = 1
            seq.block_table.append(block)
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._fresh_block())
        seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: SpecSequence) -> bool:
        """R7: True unless the newest token starts a block and no block is free.

        pre: len(seq.token_ids) >= 1
        pre: seq.block_size == self.block_size
        """
        return self.num_free_blocks >= needs_new_block(len(seq), self.block_size)

    def may_append(self, seq: SpecSequence) -> None:
        """R7: give the sequence a fresh block when its newest token starts one.

        pre: len(seq.token_ids) >= 1
        pre: seq.block_size == self.block_size
        raises: RuntimeError
        post: len(seq.block_table) == seq.num_blocks
        """
        if not seq.block_table:
            raise RuntimeError("may_append: the sequence holds no blocks")
        need = needs_new_block(len(seq), self.block_size)
        if len(seq.block_table) + need != seq.num_blocks:
            raise RuntimeError(
                f"may_append: a {len(seq)}-token sequence with {len(seq.block_table)} blocks "
                "is not one token past its block table"
            )
        if need:
            if not self.free_queue:
                raise RuntimeError("may_append: no free block")
            seq.block_table.append(self._fresh_block())

    def hash_blocks(self, seq: SpecSequence) -> None:
        """R8: register the blocks that became full in the step just computed.

        pre: seq.block_size == self.block_size
        pre: all(0 <= b < self.num_blocks and self.ref_counts[b] > 0 for b in seq.block_table)
        pre: len(set(seq.block_table)) == len(seq.block_table)
        raises: ValueError, RuntimeError
        post: seq.num_cached_tokens == __old__.seq.num_cached_tokens
        """
        cached, scheduled = seq.num_cached_tokens, seq.num_scheduled_tokens
        if cached < 0 or scheduled < 0 or cached + scheduled > len(seq):
            raise ValueError(
                f"hash_blocks: num_cached_tokens={cached} + num_scheduled_tokens={scheduled} "
                f"is outside a {len(seq)}-token sequence"
            )
        end = (cached + scheduled) // self.block_size
        if end > len(seq.block_table):
            raise RuntimeError(
                f"hash_blocks: {end} full blocks but the sequence holds {len(seq.block_table)}"
            )
        h = self._chain_start(seq)
        for i in range(end):  # the chain runs from block 0 (R4), or the salt (R4s)
            tokens = seq.block(i)
            h = self.hash_fn(tokens, h)
            if i >= cached // self.block_size:
                block = seq.block_table[i]
                self.block_hashes[block] = h
                self.block_tokens[block] = tokens
                self.hash_to_block[h] = block

    def deallocate(self, seq: SpecSequence) -> None:
        """R3: release last block first; freed blocks keep hash and tokens (lazy eviction).

        pre: all(0 <= b < self.num_blocks and self.ref_counts[b] >= seq.block_table.count(b) for b in seq.block_table)
        raises: RuntimeError
        post: seq.block_table == []
        post: seq.num_cached_tokens == 0
        """
        if not seq.block_table:
            raise RuntimeError("deallocate: the sequence holds no blocks (double release?)")
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue.append(block)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """R13: with no block in use, forget every registration (the free queue keeps its
        order) and return True; with any block in use, change nothing and return False.

        post: __return__ == (__old__.self.used_blocks() == [])
        post: self.free_queue == __old__.self.free_queue
        post: not __return__ or (self.hash_to_block == {} and self.block_hashes == [None] * self.num_blocks and self.block_tokens == [()] * self.num_blocks)
        post: __return__ or self.snapshot() == __old__.self.snapshot()
        """
        if self.used_blocks():
            return False
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        self.block_tokens = [()] * self.num_blocks
        return True

    def snapshot(self) -> SpecAllocatorState:
        """R11."""
        return SpecAllocatorState(
            free_queue=tuple(self.free_queue),
            ref_counts=tuple(self.ref_counts),
            block_hashes=tuple(self.block_hashes),
            block_tokens=tuple(self.block_tokens),
            hash_to_block=tuple(sorted(self.hash_to_block.items())),
        )

    def check_invariants(self, seqs: list[SpecSequence] | None = None) -> None:
        """R12; raises AssertionError naming the broken invariant.

        pre: seqs is None or all(0 <= b < self.num_blocks for s in seqs for b in s.block_table)
        raises: AssertionError
        """
        used = self.used_blocks()
        if sorted(self.free_queue + used) != list(range(self.num_blocks)):
            raise AssertionError("free queue and used blocks do not partition the pool")
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self.free_queue):
                raise AssertionError(f"block {b}: ref_count 0 must mean in the free queue")
            if self.ref_counts[b] > 1 and (
                self.block_hashes[b] is None or len(self.block_tokens[b]) != self.block_size
            ):
                raise AssertionError(f"block {b} is shared but not full and hashed (R9)")
        for h, b in self.hash_to_block.items():
            if not 0 <= b < self.num_blocks or self.block_hashes[b] != h:
                raise AssertionError(f"hash map entry {h} -> {b} disagrees with the block")
        if seqs is not None:
            holders = [0] * self.num_blocks
            for seq in seqs:
                for b in seq.block_table:
                    holders[b] += 1
            if holders != self.ref_counts:
                raise AssertionError(f"ref counts {self.ref_counts} != table holders {holders}")
