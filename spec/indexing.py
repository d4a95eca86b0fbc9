"""Reference index arithmetic: block counts, decode growth (R7) and slot mapping.

Each function is the obvious formula, with PEP 316 contracts that state what it means
independently of the formula. CrossHair checks the contracts; ``crosshair diffbehavior``
checks that the engine's twins in ``paged_engine.engine.indexing`` agree with these.
"""

from __future__ import annotations


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return (num_tokens + block_size - 1) // block_size


def last_block_num_tokens(num_tokens: int, block_size: int) -> int:
    """Tokens held by the last block of a ``num_tokens``-token sequence.

    pre: num_tokens >= 1
    pre: block_size >= 1
    post: 1 <= __return__ <= block_size
    post: (num_tokens - __return__) % block_size == 0
    """
    return num_tokens - (num_blocks(num_tokens, block_size) - 1) * block_size


def needs_new_block(num_tokens: int, block_size: int) -> bool:
    """R7: does the newest token (token ``num_tokens - 1``) start a new block?

    pre: num_tokens >= 1
    pre: block_size >= 1
    post: __return__ == (num_blocks(num_tokens, block_size) > num_blocks(num_tokens - 1, block_size))
    """
    return (num_tokens - 1) % block_size == 0


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of the tokens ``[start, end)`` of a sequence, through its block table.

    pre: block_size >= 1
    pre: 0 <= start <= end <= len(block_table) * block_size
    post: len(__return__) == end - start
    post: all(s // block_size == block_table[(start + k) // block_size] for k, s in enumerate(__return__))
    post: all(s % block_size == (start + k) % block_size for k, s in enumerate(__return__))
    """
    return [block_table[j // block_size] * block_size + j % block_size for j in range(start, end)]
