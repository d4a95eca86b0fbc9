"""The block allocator: paged KV blocks, ref counts, and a prefix cache over a hash chain.

Observably identical to ``spec/block_manager.py`` (same return values, block ids and
snapshots; the tests drive both in lockstep), and built for the scheduler's hot paths:

* The free queue is an ``OrderedDict`` used as an ordered set: popping the head, appending
  at the tail and reviving a cached block from *anywhere* in the queue are all O(1)
  (nano-vllm's ``deque.remove`` scans the pool for every revived block).
* Each full block's chained hash is computed once per sequence lifetime and kept in
  ``Sequence.block_hashes``; ``can_allocate`` (retried every step while a request waits),
  ``allocate``, ``hash_blocks`` and re-prefill after preemption all reuse it.
* Tokens are packed to int64 bytes with a precompiled ``struct`` per block, never
  through ``numpy.array``.
* The decode path (``can_append``/``may_append``/``hash_blocks``) is a few integer
  operations per sequence when no block boundary is crossed.

Rule numbers (R1-R12) refer to ../shared/DESIGN.md.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC

from xxhash import xxh64_intdigest

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.sequence import Sequence

__all__ = ["AllocatorState", "BlockManager", "HashFn", "xxh64_block_hash"]

HashFn = Callable[[SequenceABC[int], "int | None"], int]


def xxh64_block_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """R4: xxh64 over the previous hash (8 bytes LE, absent for block 0), then int64 LE tokens."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    if prefix is not None:
        data = prefix.to_bytes(8, "little") + data
    return xxh64_intdigest(data)


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens (R1).

    ``enable_prefix_caching=False`` turns the allocator into a plain paged allocator: no
    block is registered (R8) or looked up (R5). ``hash_fn`` replaces the chained hash (tests
    inject colliding hashes to exercise R10); sequences cache hashes, so a sequence must
    only ever be used with allocators sharing one hash function.

    ``can_allocate`` remembers its last lookup, tagged with a state version that every
    mutation bumps: the ``allocate`` that follows it (and the retries of a request blocked
    at the head of the queue while nothing changed) reuse it instead of walking the prefix
    again.
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
        # Lists, not tuples: R10 compares them with a slice of the sequence's token list.
        self.block_tokens: list[SequenceABC[int]] = [()] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_fn = hash_fn
        self._pack = struct.Struct(f"<{block_size}q").pack  # one full block, int64 LE
        self._version = 0
        self._memo: tuple[Sequence, int, int, list[int], int] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @staticmethod
    def compute_hash(token_ids: Iterable[int], prefix: int | None = None) -> int:
        """R4 with the default hash function."""
        return xxh64_block_hash(list(token_ids), prefix)

    # ---- internals -------------------------------------------------------------------

    def _state_changed(self) -> None:
        """Every mutation calls this: it invalidates the remembered lookup."""
        self._version += 1

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
        have = len(hashes)
        if have >= n:
            return hashes
        bs, tokens = self.block_size, seq.token_ids
        h = hashes[-1] if hashes else None
        if self._hash_fn is None:
            pack = self._pack
            for i in range(have, n):
                data = pack(*tokens[i * bs : (i + 1) * bs])
                h = xxh64_intdigest(data if h is None else h.to_bytes(8, "little") + data)
                hashes.append(h)
        else:
            for i in range(have, n):
                h = self._hash_fn(tokens[i * bs : (i + 1) * bs], h)
                hashes.append(h)
        return hashes

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        """R5, R10: blocks holding the sequence's first ``num_candidates`` blocks, in order,
        up to the first block that is unregistered or registered with other tokens."""
        hits: list[int] = []
        if not self.enable_prefix_caching or num_candidates <= 0:
            return hits
        # The whole chain at once: hash_blocks needs these hashes after prefill anyway.
        hashes = self._block_hashes(seq, num_candidates)
        bs, tokens = self.block_size, seq.token_ids
        hash_to_block, block_tokens = self.hash_to_block, self.block_tokens
        for i in range(num_candidates):
            block = hash_to_block.get(hashes[i])
            if block is None or block_tokens[block] != tokens[i * bs : (i + 1) * bs]:
                break
            hits.append(block)
        return hits

    def _hits(self, seq: Sequence) -> tuple[list[int], int]:
        """R5: the hits and the free blocks admitting ``seq`` costs (a hit in use costs
        nothing; a revived hit and each fresh block cost one), remembered until the state
        or the sequence changes."""
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
        ref_counts = self.ref_counts
        needed = n - sum(1 for b in hits if ref_counts[b])
        self._memo = (seq, self._version, seq.num_tokens, hits, needed)
        return hits, needed

    def _take_hit(self, block: int) -> None:
        """R6 for one hit: share it if in use, else revive it from anywhere in the queue."""
        if self.ref_counts[block]:
            self.ref_counts[block] += 1
        else:
            del self.free_blocks[block]  # O(1), wherever it stands
            self.ref_counts[block] = 1

    # ---- the allocator API -----------------------------------------------------------

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
        last = seq.num_tokens - 1
        bs = self.block_size
        if last % bs:  # the newest token lands in the last block: nothing to do
            if table and len(table) == last // bs + 1:
                return
        elif table and len(table) == last // bs:
            if not self.free_blocks:
                raise RuntimeError("may_append: no free block")
            self._state_changed()
            table.append(self._fresh_block())
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
        start, end = cached // bs, total // bs
        table = seq.block_table
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
        hashes, tokens = self._block_hashes(seq, end), seq.token_ids
        for i in range(start, end):
            block, h = table[i], hashes[i]
            self.block_hashes[block] = h
            self.block_tokens[block] = tokens[i * bs : (i + 1) * bs]
            self.hash_to_block[h] = block  # overwrite: the newest registration wins

    def deallocate(self, seq: Sequence) -> None:
        """R3: release last block first; freed blocks keep hash and tokens until reused."""
        table = seq.block_table
        if not table:
            raise RuntimeError("deallocate: the sequence holds no blocks (double release?)")
        self._state_changed()
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
            block_tokens=tuple(tuple(t) for t in self.block_tokens),
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
