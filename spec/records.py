"""What the reference models report: the allocator's observable state (R11), the
scheduler's statistics (S12) and the model's failed-sample marker (S8, S9).

They exist so that the spec imports nothing from the engine it specifies. Had the spec
shared the engine's records, a field defined wrongly there (a default, a missing or extra
counter) would be wrong on both sides of the lockstep alike and never differ. These are
written from the rules alone; the tests compare them with the engine's field by field, by
name, and translate the engine's failed-sample marker into ``SpecFailedSample`` where the
model's results enter the spec (tests/lockstep.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpecAllocatorState", "SpecFailedSample", "SpecSchedulerStats"]


@dataclass(frozen=True, slots=True)
class SpecAllocatorState:
    """R11: everything an allocator's future behaviour depends on, comparable with ``==``.
    Two allocators are equivalent when every call returns the same value, every sequence
    gets the same table and ``num_cached_tokens``, and these states are equal."""

    free_queue: tuple[int, ...]
    """R1, R2, R3: the free block ids, the head (the next to be reused) first."""
    ref_counts: tuple[int, ...]
    """R1: how many block tables hold each block."""
    block_hashes: tuple[int | None, ...]
    """R8: each block's chained hash (R4), None where no full block is registered."""
    block_tokens: tuple[tuple[int, ...], ...]
    """R8, R10: the tokens recorded with each block's hash, () where none."""
    hash_to_block: tuple[tuple[int, int], ...]
    """R5, R8: the prefix-cache map as ``(hash, block)`` pairs, sorted by hash."""


@dataclass(frozen=True, slots=True)
class SpecFailedSample:
    """S8, S9: the model's result for a sequence it could not sample (its logits were not
    finite). The sequence appends nothing and finishes with "error", ``reason`` as its
    stop reason; the rest of the batch goes on."""

    reason: str


@dataclass(slots=True)
class SpecSchedulerStats:
    """S12: counters over the scheduler's lifetime, each changed only where its rule says.

    Every field starts at 0. The engine's statistics must have exactly these fields, with
    the same values after every step.
    """

    prefill_tokens: int = 0
    """Tokens computed by prefill steps (S3: prompts, and recomputed tokens after S7 or
    S11), counted when the step's results are applied (S8), chunks that sample included."""
    decode_tokens: int = 0
    """One per sequence of a decode step (S6) whose results were applied (S8)."""
    output_tokens: int = 0
    """Tokens sampled and appended (S8); a failed sample appends nothing and counts none."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the prefix cache served (S5, R5), at each sequence's first admission
    only (S4): a readmission after a preemption counts nothing."""
    prompt_tokens: int = 0
    """Prompt tokens of the sequences admitted, at each one's first admission only (S4)."""
    preemptions: int = 0
    """Sequences sent back to waiting for want of a block (S7); a recovery (S11) is not one."""
    peak_blocks_in_use: int = 0
    """The most blocks held at once, measured after each step is scheduled (S2)."""
    steps: int = 0
    """Steps scheduled (S2): every ``schedule`` that returned a batch."""
    failed_steps: int = 0
    """Steps that raised and left sequences to recover (S11)."""
