"""The block pool: KV block ids ``0..N-1``, their ref counts, the FIFO free queue, and
the prefix cache's registrations (each block's hash and tokens, and the hash map).

The per-block operations the allocator builds on (R2's fresh blocks and their eviction,
R13's reset) and its observation (R11's snapshot, R12's invariants). ``BlockManager``
(paged_engine.engine.block_manager) inherits it and adds the per-sequence API.

The free queue is an ``OrderedDict`` used as an ordered set: popping the head, appending
at the tail and reviving a cached block from *anywhere* in the queue are all O(1)
(nano-vllm's ``deque.remove`` scans the pool for every revived block).

Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.hashing import BlockHasher, HashFn
from paged_engine.engine.sequence import Sequence

__all__ = ["BlockPool"]


class BlockPool(BlockHasher):
    """``num_blocks`` KV blocks of ``block_size`` tokens (R1), hashed as ``BlockHasher``
    says (``hash_fn``, ``hash_algorithm``).

    Every mutation bumps ``_version`` (through ``_state_changed``), so that a lookup
    remembered in one state is never reused in another.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_fn: HashFn | None = None,
        hash_algorithm: str = "xxh64",
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        super().__init__(block_size, hash_fn=hash_fn, hash_algorithm=hash_algorithm)
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # Each registered block's tokens, packed as the hash reads them (int64 LE; b"" when
        # unset): R10 compares them with one memcmp, and the GC never walks them.
        # Shared with the registering sequence's ``block_bytes``.
        self.block_tokens: list[bytes] = [b""] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._version = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _state_changed(self) -> None:
        """Every mutation calls this: it invalidates the remembered lookup."""
        self._version += 1

    def _take_fresh_blocks(self, table: list[int], n: int) -> None:
        """R2: move the free queue's first ``n`` blocks into ``table``, each unregistered
        (its stale registration dropped) while still free and held as soon as taken, so a
        fault anywhere leaves every block free or in the table (R12). The caller has
        checked that ``n`` blocks are free."""
        free, ref_counts, block_hashes = self.free_blocks, self.ref_counts, self.block_hashes
        for _ in range(n):
            block = next(iter(free))
            if block_hashes[block] is not None:
                self._unregister(block)
            del free[block]
            ref_counts[block] = 1
            table.append(block)

    def _unregister(self, block: int) -> None:
        """R2's eviction: forget the block's hash and tokens, and its map entry if the
        entry still points to it (a newer block with the same hash may own it)."""
        old = self.block_hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hashes[block] = None
        self.block_tokens[block] = b""

    def reset_prefix_cache(self) -> bool:
        """R13: with every block free, forget every registration (the free queue keeps its
        order) and return True; with any block in use, change nothing and return False."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        self._state_changed()  # a remembered lookup's hits are gone
        self.hash_to_block.clear()
        self.block_hashes[:] = [None] * self.num_blocks
        self.block_tokens[:] = [b""] * self.num_blocks
        return True

    # ---- observation -----------------------------------------------------------------

    def snapshot(self) -> AllocatorState:
        """R11."""
        return AllocatorState(
            free_queue=tuple(self.free_blocks),
            ref_counts=tuple(self.ref_counts),
            block_hashes=tuple(self.block_hashes),
            # Registered blocks are full; b"" (or a test's ()) means no tokens recorded.
            block_tokens=tuple(self._unpack_block(t) if t else () for t in self.block_tokens),
            hash_to_block=tuple(sorted(self.hash_to_block.items())),
        )

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """R12 in O(pool + tables); raises AssertionError naming what is broken."""
        free = self.free_blocks
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref_count {rc} but in free queue: {b in free}")
            if rc > 1 and (
                self.block_hashes[b] is None or len(self.block_tokens[b]) != self._block_nbytes
            ):
                raise AssertionError(f"block {b} is shared but not full and hashed (R9)")
        if any(not 0 <= b < self.num_blocks for b in free):
            raise AssertionError("free queue holds an id outside the pool")
        n = self.num_blocks
        for h, b in self.hash_to_block.items():
            if not 0 <= b < n or self.block_hashes[b] != h:
                raise AssertionError(f"hash map entry {h} -> {b} disagrees with the block")
        if seqs is not None:
            holders = [0] * n
            for seq in seqs:
                for b in seq.block_table:
                    if not 0 <= b < n:
                        raise AssertionError(f"{seq} holds block {b}, outside the pool")
                    holders[b] += 1
            if holders != self.ref_counts:
                raise AssertionError(f"ref counts {self.ref_counts} != table holders {holders}")
