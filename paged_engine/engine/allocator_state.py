"""The observable state of a block allocator (R11), shared by the spec and the engine.

Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """Everything an allocator's future behaviour depends on, in comparable form.

    Two allocators are equivalent when every call returns the same value, every sequence
    gets the same block table and ``num_cached_tokens``, and their snapshots are equal.
    Building one costs O(pool); it is for tests and debugging, not for the hot path.
    """

    free_queue: tuple[int, ...]
    """Free block ids, head (next to be reused) first."""
    ref_counts: tuple[int, ...]
    block_hashes: tuple[int | None, ...]
    """Chained hash of each block, None where the block is not full and registered."""
    block_tokens: tuple[tuple[int, ...], ...]
    hash_to_block: tuple[tuple[int, int], ...]
    """The prefix-cache map as ``(hash, block_id)`` pairs sorted by hash."""
