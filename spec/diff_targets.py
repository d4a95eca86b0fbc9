"""Domain-guarded index helpers of the spec, the spec's half of ``crosshair diffbehavior``.

``crosshair diffbehavior`` compares two functions on every input it can construct and
ignores PEP 316 ``pre:`` lines, so comparing ``paged_engine.engine.indexing.num_blocks``
with ``spec.indexing.num_blocks`` directly reports differences at ``block_size = -1``,
where neither is defined (``-(-10 // -1) == -10`` but ``(10 - 1 - 1) // -1 == -8``). Each
helper therefore gets a wrapper per side that returns ``None`` outside the spec's
preconditions and the helper's answer inside them: both sides agree trivially off the
domain, so any difference CrossHair finds is one on the domain.

The guards restate the ``pre:`` lines of ``spec/indexing.py`` as plain code. This module
holds them and the spec's wrappers; the engine's wrappers, behind the same guards, live in
tests/test_spec_diff_targets.py, since the spec imports nothing from the engine.
``scripts/run_crosshair.py`` lists the pairs in ``DIFF_PAIRS``.
"""

from __future__ import annotations

from spec import indexing as spec


def count_domain(num_tokens: int, block_size: int, min_tokens: int) -> bool:
    """The ``pre:`` lines of the counting helpers: ``num_tokens >= min_tokens`` (0 for
    ``num_blocks``, 1 for the helpers about a sequence's newest token), ``block_size >= 1``.
    """
    return num_tokens >= min_tokens and block_size >= 1


def slot_domain(block_table: list[int], block_size: int, start: int, end: int) -> bool:
    """The ``pre:`` lines of ``slot_mapping``: a token range inside the table's blocks."""
    return block_size >= 1 and 0 <= start <= end <= len(block_table) * block_size


def num_blocks_spec(num_tokens: int, block_size: int) -> int | None:
    """``spec.num_blocks`` on its domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 0):
        return None
    return spec.num_blocks(num_tokens, block_size)


def last_block_num_tokens_spec(num_tokens: int, block_size: int) -> int | None:
    """``spec.last_block_num_tokens`` on its domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 1):
        return None
    return spec.last_block_num_tokens(num_tokens, block_size)


def needs_new_block_spec(num_tokens: int, block_size: int) -> bool | None:
    """``spec.needs_new_block`` (R7) on its domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 1):
        return None
    return spec.needs_new_block(num_tokens, block_size)


def slot_mapping_spec(
    block_table: list[int], block_size: int, start: int, end: int
) -> list[int] | None:
    """``spec.slot_mapping`` on its domain, ``None`` elsewhere."""
    if not slot_domain(block_table, block_size, start, end):
        return None
    return spec.slot_mapping(block_table, block_size, start, end)
