"""The engine's half of the ``crosshair diffbehavior`` pairs, and a plain check of each pair.

``spec/diff_targets.py`` holds the domain guards and the spec's wrappers; the engine's
wrappers live here, behind the same guards, because the spec imports nothing from the
engine. ``scripts/run_crosshair.py`` diffs ``tests.test_spec_diff_targets.<helper>_engine``
against ``spec.diff_targets.<helper>_spec`` (CrossHair imports this module by that name,
as it imports tests/test_crosshair.py's broken twins). The tests below compare every pair
on a small grid, inside and outside the domain, so a pair that stops matching fails in the
ordinary suite too, not only under CrossHair.
"""

from __future__ import annotations

import itertools

import pytest

from paged_engine.engine import indexing as engine
from spec import diff_targets as spec_targets
from spec.diff_targets import count_domain, slot_domain


def num_blocks_engine(num_tokens: int, block_size: int) -> int | None:
    """``engine.num_blocks`` on the spec's domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 0):
        return None
    return engine.num_blocks(num_tokens, block_size)


def last_block_num_tokens_engine(num_tokens: int, block_size: int) -> int | None:
    """``engine.last_block_num_tokens`` on the spec's domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 1):
        return None
    return engine.last_block_num_tokens(num_tokens, block_size)


def needs_new_block_engine(num_tokens: int, block_size: int) -> bool | None:
    """``engine.needs_new_block`` (R7) on the spec's domain, ``None`` elsewhere."""
    if not count_domain(num_tokens, block_size, 1):
        return None
    return engine.needs_new_block(num_tokens, block_size)


def slot_mapping_engine(
    block_table: list[int], block_size: int, start: int, end: int
) -> list[int] | None:
    """``engine.slot_mapping`` on the spec's domain, ``None`` elsewhere."""
    if not slot_domain(block_table, block_size, start, end):
        return None
    return engine.slot_mapping(block_table, block_size, start, end)


COUNTING = ["num_blocks", "last_block_num_tokens", "needs_new_block"]
GRID = list(itertools.product(range(-2, 20), range(-2, 7)))
"""(num_tokens, block_size): the domain's corners (0 and 1 tokens, block size 1) and
beyond it (negative counts, block sizes 0 and below)."""


@pytest.mark.parametrize("helper", COUNTING)
def test_each_counting_pair_agrees_on_the_grid(helper: str) -> None:
    ours = globals()[f"{helper}_engine"]
    theirs = getattr(spec_targets, f"{helper}_spec")
    diffs = [(n, bs) for n, bs in GRID if ours(n, bs) != theirs(n, bs)]
    assert diffs == [], f"{helper}: engine and spec differ at (num_tokens, block_size) {diffs}"
    # Not vacuous: both sides answer on the domain, and only there.
    answered = [(n, bs) for n, bs in GRID if ours(n, bs) is not None]
    minimum = 0 if helper == "num_blocks" else 1
    assert answered == [(n, bs) for n, bs in GRID if n >= minimum and bs >= 1]


def test_the_slot_mapping_pair_agrees_on_every_small_range() -> None:
    table = [5, 2, 7]
    cases = [
        (table[:k], bs, start, end)
        for k in range(4)
        for bs in range(0, 4)
        for start in range(-1, k * max(bs, 1) + 2)
        for end in range(start, k * max(bs, 1) + 2)
    ]
    diffs = [c for c in cases if slot_mapping_engine(*c) != spec_targets.slot_mapping_spec(*c)]
    assert diffs == [], f"slot_mapping: engine and spec differ at {diffs[:5]}"
    # By hand, at block size 2: block 5 holds slots 10-11, block 2 4-5, block 7 14-15.
    assert slot_mapping_engine(table, 2, 0, 2) == [10, 11]
    assert slot_mapping_engine(table, 2, 3, 6) == [5, 14, 15]
    assert slot_mapping_engine(table, 2, 4, 4) == []
    assert slot_mapping_engine(table, 2, 5, 7) is None  # past the table's 6 slots
