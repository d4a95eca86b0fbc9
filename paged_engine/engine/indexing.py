"""Index arithmetic shared by the allocator, the scheduler and the model runner.

Twins of ``spec/indexing.py`` (which states what each one means, with contracts that
CrossHair checks); ``crosshair diffbehavior`` checks each pair agrees. These are the
forms used on hot paths. Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


def last_block_num_tokens(num_tokens: int, block_size: int) -> int:
    """Tokens in the last block of a ``num_tokens``-token sequence (``num_tokens >= 1``)."""
    return (num_tokens - 1) % block_size + 1


def needs_new_block(num_tokens: int, block_size: int) -> bool:
    """R7: the newest token is the first of a block, so decode needs a fresh block.

    nano-vllm writes ``num_tokens % block_size == 1``, which is never true for
    ``block_size == 1``; ``(n - 1) % bs == 0`` holds for every block size.
    """
    return (num_tokens - 1) % block_size == 0


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of tokens ``[start, end)`` through ``block_table``, one range per block."""
    slots: list[int] = []
    first, last = start // block_size, (end - 1) // block_size
    for i in range(first, last + 1):
        base = block_table[i] * block_size
        lo = start - i * block_size if i == first else 0
        hi = end - i * block_size if i == last else block_size
        slots.extend(range(base + lo, base + hi))
    return slots
