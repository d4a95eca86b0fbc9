"""The block allocator: paged KV blocks, ref counts, and a prefix cache over a hash chain.

Observably identical to ``spec/block_manager.py`` (same return values, block ids and
snapshots; the tests drive both in lockstep), and built for the scheduler's hot paths:

* The free queue is an ``OrderedDict`` used as an ordered set: popping the head, appending
  at the tail and reviving a cached block from *anywhere* in the queue are all O(1)
  (nano-vllm's ``deque.remove`` scans the pool for every revived block).
* Each full block's chained hash is computed once per sequence lifetime and kept in
  ``Sequence.block_hashes``; ``can_allocate`` (retried every step while a request waits),
  ``allocate``, ``hash_blocks`` and re-prefill after preemption all reuse it.
* Tokens are packed to bytes with ``array('q')`` per block, never through ``numpy.array``.
* The decode path (``can_append``/``may_append``/``hash_blocks``) is a few integer
  operations per sequence when no block boundary is crossed.

Rule numbers (R1-R12) refer to ../shared/DESIGN.md.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC

from xxhash import xxh64_intdigest

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.sequence import Sequence

__all__ = ["AllocatorState", "BlockManager", "HashFn", "xxh64_block_hash"]

HashFn = Callable[[SequenceABC[int], "int | None"], int]
_LITTLE_ENDIAN = sys.byteorder == "little"


def xxh64_block_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """R4: xxh64 over the previous hash (8 bytes LE, absent for block 0), then int64 LE tokens."""
    packed = array("q", token_ids)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    data = packed.tobytes()
    if prefix is not None:
        data = prefix.to_bytes(8, "little") + data
    return xxh64_intdigest(data)


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens (R1).

    ``enable_prefix_caching=False`` turns the allocator into a plain paged allocator: no
    block is registered (R8) or looked up (R5). ``hash_fn`` replaces the chained hash (tests
    inject colliding hashes to exercise R10); sequences cache hashes, so a sequence must
    only ever be used with allocators sharing one hash function.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash: HashFn = hash_fn or xxh64_block_hash

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @staticmethod
    def compute_hash(token_ids: Iterable[int], prefix: int | None = None) -> int:
        """R4 with the default hash function."""
        return xxh64_block_hash(list(token_ids), prefix)

    # ---- internals -------------------------------------------------------------------

    def _fresh_block(self) -> int:
        """R2: take the head of the free queue; drop its registration if still its own."""
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_hashes[block]
        if old is not None:
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hashes[block] = None
            self.block_tokens[block] = ()
        self.ref_counts[block] = 1
        return block

    def _block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """The sequence's hash chain, extended to at least its first ``n`` (full) blocks."""
        hashes = seq.block_hashes
        if len(hashes) < n:
            bs, tokens, hash_fn = self.block_size, seq.token_ids, self._hash
            h = hashes[-1] if hashes else None
            for i in range(len(hashes), n):
                h = hash_fn(tokens[i * bs : (i + 1) * bs], h)
                hashes.append(h)
        return hashes

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        """R5, R10: blocks holding the sequence's first ``num_candidates`` blocks, in order,
        up to the first block that is unregistered or registered with other tokens."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        bs, tokens, hashes = self.block_size, seq.token_ids, seq.block_hashes
        hash_to_block, block_tokens = self.hash_to_block, self.block_tokens
        for i in range(num_candidates):
            h = hashes[i] if i < len(hashes) else self._block_hashes(seq, i + 1)[i]
            block = hash_to_block.get(h)
            if block is None or block_tokens[block] != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def _take_hit(self, block: int) -> None:
        """R6 for one hit: share it if in use, else revive it from anywhere in the queue."""
        if self.ref_counts[block]:
            self.ref_counts[block] += 1
        else:
            del self.free_blocks[block]  # O(1), wherever it stands
            self.ref_counts[block] = 1

    def _blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        """R5: a hit in use costs nothing; a revived hit and each fresh block cost one."""
        ref_counts = self.ref_counts
        return seq.num_blocks - sum(1 for b in hits if ref_counts[b])

    # ---- the allocator API -----------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> int | None:
        """R5: how many leading blocks the prefix cache holds, or None if the pool is short."""
        hits = self._lookup(seq, seq.num_blocks - 1)  # the last block is never looked up
        if len(self.free_blocks) < self._blocks_needed(seq, hits):
            return None
        return len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """R6: attach the hits (shared or revived), then fresh blocks from the queue head."""
        if seq.block_table:
            raise RuntimeError("allocate: the sequence already holds blocks")
        hits = self._lookup(seq, seq.num_blocks - 1)
        if num_cached_blocks != len(hits):
            raise ValueError(
                f"allocate: num_cached_blocks={num_cached_blocks}, but the prefix cache "
                f"holds {len(hits)} leading blocks of this sequence"
            )
        if len(self.free_blocks) < self._blocks_needed(seq, hits):
            raise RuntimeError("allocate: not enough free blocks for this sequence")
        table = seq.block_table
        for block in hits:
            self._take_hit(block)
            table.append(block)
        for _ in range(seq.num_blocks - len(hits)):
            table.append(self._fresh_block())
        seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """R7: a free block exists, or the newest token does not start a new block."""
        return bool(self.free_blocks) or (seq.num_tokens - 1) % self.block_size != 0

    def may_append(self, seq: Sequence) -> None:
        """R7: give the sequence a fresh block when its newest token starts one."""
        table = seq.block_table
        full, offset = divmod(seq.num_tokens - 1, self.block_size)
        if not table:
            raise RuntimeError("may_append: the sequence holds no blocks")
        if len(table) != full + (offset != 0):
            raise RuntimeError(
                f"may_append: a {seq.num_tokens}-token sequence with {len(table)} blocks "
                "is not one token past its block table"
            )
        if offset == 0:
            if not self.free_blocks:
                raise RuntimeError("may_append: no free block")
            table.append(self._fresh_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """R8: register the blocks that became full in the step just computed."""
        cached, scheduled = seq.num_cached_tokens, seq.num_scheduled_tokens
        if cached < 0 or scheduled < 0 or cached + scheduled > seq.num_tokens:
            raise ValueError(
                f"hash_blocks: num_cached_tokens={cached} + num_scheduled_tokens={scheduled} "
                f"is outside a {seq.num_tokens}-token sequence"
            )
        bs = self.block_size
        start, end = cached // bs, (cached + scheduled) // bs
        table = seq.block_table
        if end > len(table):
            raise RuntimeError(
                f"hash_blocks: {end} full blocks but the sequence holds {len(table)}"
            )
        if start == end or not self.enable_prefix_caching:
            return
        hashes, tokens = self._block_hashes(seq, end), seq.token_ids
        for i in range(start, end):
            block, h = table[i], hashes[i]
            self.block_hashes[block] = h
            self.block_tokens[block] = tuple(tokens[i * bs : (i + 1) * bs])
            self.hash_to_block[h] = block  # overwrite: the newest registration wins

    def deallocate(self, seq: Sequence) -> None:
        """R3: release last block first; freed blocks keep hash and tokens until reused."""
        table = seq.block_table
        if not table:
            raise RuntimeError("deallocate: the sequence holds no blocks (double release?)")
        ref_counts, free = self.ref_counts, self.free_blocks
        for block in reversed(table):
            ref_counts[block] -= 1
            if not ref_counts[block]:
                free[block] = None
        table.clear()
        seq.num_cached_tokens = 0

    # ---- observation -----------------------------------------------------------------

    def snapshot(self) -> AllocatorState:
        """R11."""
        return AllocatorState(
            free_queue=tuple(self.free_blocks),
            ref_counts=tuple(self.ref_counts),
            block_hashes=tuple(self.block_hashes),
            block_tokens=tuple(self.block_tokens),
            hash_to_block=tuple(sorted(self.hash_to_block.items())),
        )

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """R12 in O(pool + tables); raises AssertionError naming what is broken."""
        free = self.free_blocks
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref_count {rc} but in free queue: {b in free}")
            if rc > 1 and (
                self.block_hashes[b] is None or len(self.block_tokens[b]) != self.block_size
            ):
                raise AssertionError(f"block {b} is shared but not full and hashed (R9)")
        if any(not 0 <= b < self.num_blocks for b in free):
            raise AssertionError("free queue holds an id outside the pool")
        for h, b in self.hash_to_block.items():
            if self.block_hashes[b] != h:
                raise AssertionError(f"hash map entry {h} -> {b} disagrees with the block")
        if seqs is not None:
            holders = [0] * self.num_blocks
            for seq in seqs:
                for b in seq.block_table:
                    holders[b] += 1
            if holders != self.ref_counts:
                raise AssertionError(f"ref counts {self.ref_counts} != table holders {holders}")
