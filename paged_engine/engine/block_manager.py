"""The block allocator: paged KV blocks, ref counts, and a prefix cache over a hash chain.

Observably identical to ``spec/block_manager.py`` (same return values, block ids and
snapshots; the tests drive both in lockstep), and built for the scheduler's hot paths.
``BlockManager`` is the per-sequence API, in the order a request meets it
(``can_allocate``, ``allocate``, ``can_append``, ``may_append``, ``hash_blocks``,
``deallocate``), over two layers it inherits: ``paged_engine.engine.block_pool.BlockPool``
(block ids, ref counts, the O(1) free queue, the registrations; snapshots and
invariants) and ``paged_engine.engine.hashing.BlockHasher`` (each full block hashed and
packed once per sequence lifetime). Here:

* The prefix walk runs its dict lookups and token checks through ``map`` (C loops);
  Python-level loops remain only for hashing and for ref counts.
* Each per-block step is written once, inside the loop over the blocks, never as a call
  per block: a Python call costs more than the work it wraps (bench/test_allocator_bench.py
  measures the allocator). Likewise ``hash_blocks`` hashes the one block a decode step
  fills itself; every other chain extension goes through ``BlockHasher.hash_chain``.
* The decode path (``can_append``/``may_append``/``hash_blocks``) is a few integer
  operations per sequence when no block boundary is crossed.

Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations

from typing import cast

from xxhash import xxh64_intdigest

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.block_pool import BlockPool
from paged_engine.engine.hashing import (
    HASH_ALGORITHMS,
    HashFn,
    salt_block,
    sha256_block_hash,
    xxh64_block_hash,
)
from paged_engine.engine.sequence import Sequence

__all__ = [
    "HASH_ALGORITHMS",
    "AllocatorState",
    "BlockManager",
    "HashFn",
    "salt_block",
    "sha256_block_hash",
    "xxh64_block_hash",
]


class BlockManager(BlockPool):
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens (R1).

    ``enable_prefix_caching=False`` turns the allocator into a plain paged allocator: no
    block is registered (R8) or looked up (R5). ``hash_fn`` replaces the chained hash
    (tests inject colliding hashes to exercise R10); ``hash_algorithm`` picks R4's hash,
    "xxh64" or "sha256" (see ``BlockHasher``). Pass one of the two.

    ``can_allocate`` remembers its last lookup, tagged with the pool's state version,
    which every mutation bumps: the ``allocate`` that follows it (and the retries of a
    request blocked at the head of the queue while nothing changed) reuse it instead of
    walking the prefix again.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        hash_algorithm: str = "xxh64",
    ) -> None:
        super().__init__(num_blocks, block_size, hash_fn=hash_fn, hash_algorithm=hash_algorithm)
        self.enable_prefix_caching = enable_prefix_caching
        self._memo: tuple[Sequence, int, int, list[int], int] | None = None

    def can_allocate(self, seq: Sequence) -> int | None:
        """R5: how many leading blocks the prefix cache holds, or None if the pool is short."""
        hits, needed = self._hits(seq)
        return None if len(self.free_blocks) < needed else len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """R6: attach the hits (shared or revived), then fresh blocks from the queue head."""
        if seq.block_table:
            raise RuntimeError("allocate: the sequence already holds blocks")
        hits, needed = self._hits(seq)
        if num_cached_blocks != len(hits):
            raise ValueError(
                f"allocate: num_cached_blocks={num_cached_blocks}, but the prefix cache "
                f"holds {len(hits)} leading blocks of this sequence"
            )
        if len(self.free_blocks) < needed:
            raise RuntimeError("allocate: not enough free blocks for this sequence")
        self._state_changed()
        ref_counts, free = self.ref_counts, self.free_blocks
        for block in hits:  # R6: share a hit in use, revive one from anywhere in the queue
            rc = ref_counts[block]
            if not rc:
                del free[block]  # O(1), wherever it stands
            ref_counts[block] = rc + 1
        table = seq.block_table
        table += hits
        self._take_fresh_blocks(table, seq.num_blocks - len(hits))  # R2
        seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """R7: a free block exists, or the newest token does not start a new block."""
        if self.free_blocks:
            return True
        return (seq.num_tokens - 1) % self.block_size != 0

    def may_append(self, seq: Sequence) -> None:
        """R7: give the sequence a fresh block when its newest token starts one."""
        table = seq.block_table
        bs = self.block_size
        # The common decode step, in one test: the newest token lands in the table's last
        # block, past its first slot: (len(table) - 1) * bs + 2 <= num_tokens <=
        # len(table) * bs. Never true for an empty table (num_tokens >= 1), nor with
        # block_size 1, where every token starts a block.
        if 0 <= len(table) * bs - seq.num_tokens < bs - 1:
            return
        last = seq.num_tokens - 1
        if last % bs == 0 and table and len(table) == last // bs:
            if not self.free_blocks:
                raise RuntimeError("may_append: no free block")
            self._state_changed()
            self._take_fresh_blocks(table, 1)  # R2
            return
        if not table:
            raise RuntimeError("may_append: the sequence holds no blocks")
        raise RuntimeError(
            f"may_append: a {seq.num_tokens}-token sequence with {len(table)} blocks "
            "is not one token past its block table"
        )

    def hash_blocks(self, seq: Sequence) -> None:
        """R8: register the blocks that became full in the step just computed."""
        cached = seq.num_cached_tokens
        total = cached + seq.num_scheduled_tokens
        bs = self.block_size
        start, end, table = cached // bs, total // bs, seq.block_table
        if start == end and 0 <= cached <= total <= seq.num_tokens and end <= len(table):
            return  # the common decode step: no block filled, arguments valid
        if cached < 0 or total < cached or total > seq.num_tokens:
            raise ValueError(
                f"hash_blocks: num_cached_tokens={cached} + num_scheduled_tokens="
                f"{seq.num_scheduled_tokens} is outside a {seq.num_tokens}-token sequence"
            )
        if end > len(table):
            raise RuntimeError(
                f"hash_blocks: {end} full blocks but the sequence holds {len(table)}"
            )
        if start == end or not self.enable_prefix_caching:
            return
        self._state_changed()
        hashes, packed = seq.block_hashes, seq.block_bytes
        if end - start == 1 and len(hashes) == len(packed) == start > 0 and self._xxh64:
            # A decode step filled one block (every block_size steps of each sequence):
            # packed, hashed (R4, as hash_chain does) and registered right here, since a
            # call per filled block would cost more than the work.
            data = self._pack_block(*seq.token_ids[start * bs : end * bs])
            h = xxh64_intdigest(hashes[-1].to_bytes(8, "little") + data)
            packed.append(data)
            hashes.append(h)
            block = table[start]
            self.block_hashes[block] = h
            self.block_tokens[block] = data
            self.hash_to_block[h] = block
            return
        hashes = self.hash_chain(seq, end)  # packs the blocks it hashes
        block_hashes, block_tokens, hash_to_block = (
            self.block_hashes,
            self.block_tokens,
            self.hash_to_block,
        )
        for i in range(start, end):
            block, h = table[i], hashes[i]
            block_hashes[block] = h
            block_tokens[block] = packed[i]
            hash_to_block[h] = block  # overwrite: the newest registration wins

    def deallocate(self, seq: Sequence) -> None:
        """R3: release last block first; freed blocks keep hash and tokens until reused."""
        table = seq.block_table
        if not table:
            raise RuntimeError("deallocate: the sequence holds no blocks (double release?)")
        self._state_changed()
        ref_counts, free = self.ref_counts, self.free_blocks
        for block in reversed(table):
            rc = ref_counts[block] - 1
            ref_counts[block] = rc
            if not rc:
                free[block] = None
        table.clear()
        seq.num_cached_tokens = 0

    # ---- the prefix lookup -----------------------------------------------------------

    def _hits(self, seq: Sequence) -> tuple[list[int], int]:
        """R5: the hits and the free blocks admitting ``seq`` costs (a hit in use costs
        nothing; a revived hit and each fresh block cost one), remembered until the state
        or the sequence changes.

        The cost is only ever compared with the free blocks in that same state, so when
        they are at least ``seq.num_blocks`` (the most it can be), that bound stands in
        for it and the hits' ref counts go unread.
        """
        if seq.block_size != self.block_size:
            raise ValueError(
                f"the sequence's block_size {seq.block_size} != the allocator's {self.block_size}"
            )
        memo = self._memo
        if (
            memo is not None
            and memo[0] is seq
            and memo[1] == self._version
            and memo[2] == seq.num_tokens
        ):
            return memo[3], memo[4]
        n = seq.num_blocks
        hits = self._lookup(seq, n - 1)  # the last block is never looked up
        needed = n
        if len(self.free_blocks) < n:
            # Fresh blocks plus revived hits (ref count 0), counted at C speed.
            needed -= len(hits) - list(map(self.ref_counts.__getitem__, hits)).count(0)
        self._memo = (seq, self._version, seq.num_tokens, hits, needed)
        return hits, needed

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        """R5, R10: blocks holding the sequence's first ``num_candidates`` blocks, in order,
        up to the first block that is unregistered or registered with other tokens."""
        if not self.enable_prefix_caching or num_candidates <= 0:
            return []
        # The whole chain at once: hash_blocks needs these hashes after prefill anyway.
        hashes = self.hash_chain(seq, num_candidates)
        packed = seq.block_bytes
        # R5: the blocks registered under the leading hashes, up to the first miss.
        found = list(map(self.hash_to_block.get, hashes[:num_candidates]))
        try:  # one scan (comparing with None is slow: neither int nor None knows the other)
            hits = cast("list[int]", found[: found.index(None)])
        except ValueError:
            hits = cast("list[int]", found)  # every candidate's hash is registered
        # R10: all of them hold the sequence's tokens, unless a hash collided.
        block_tokens = self.block_tokens
        if list(map(block_tokens.__getitem__, hits)) != packed[: len(hits)]:
            for i, (block, data) in enumerate(zip(hits, packed, strict=False)):
                if block_tokens[block] != data:
                    del hits[i:]
                    break
        return hits
