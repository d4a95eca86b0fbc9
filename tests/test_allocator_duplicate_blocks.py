"""Two blocks with the same hash (R2): two sequences prefill the same prompt in one step,
before either has registered its blocks, so each computes its own copy and the newer copy
owns the hash's map entry. Reusing the older copy must leave that entry alone.

The lockstep machine (tests/test_mutants.py) catches the mutant that breaks this,
R2UnguardedDelete, after 220 of the hunt's test cases. Before tests/conftest.py kept
Hypothesis from drawing constants found in the loaded modules, that catch moved with what
earlier tests had imported (example 362 of 400 in a full run), and a `pytest -k` selection
missed it: this hand-worked case catches it in any order, with the exact block ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged_engine.engine.sequence import Sequence
from tests import allocator_mutants as mutants
from tests.test_allocator_examples import IMPLS, admit, compute_rest


def reuse_an_older_duplicate(bm_cls: Any, make: Any) -> None:
    """The case, on any allocator class and sequence maker; asserts exact block ids."""
    bm = bm_cls(6, 2)
    prompt = [1, 2, 3, 4, 5]  # two full blocks and one token
    first, second = make(prompt, 2), make(prompt, 2)
    assert (admit(bm, first), admit(bm, second)) == (0, 0)  # nothing registered yet
    compute_rest(bm, first)  # registers blocks 0 and 1
    compute_rest(bm, second)  # the same hashes: blocks 3 and 4 now own the entries
    assert (first.block_table, second.block_table) == ([0, 1, 2], [3, 4, 5])
    bm.deallocate(first)
    bm.deallocate(second)
    other = make([9] * 5, 2)
    assert admit(bm, other) == 0
    assert other.block_table == [2, 1, 0]  # reuses the older copies, 1 and 0
    bm.deallocate(other)
    third = make(prompt, 2)
    # The entries still lead to the newer copies, revived from the free queue.
    assert admit(bm, third) == 2
    assert third.block_table == [3, 4, 5]
    assert third.num_cached_tokens == 4


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_reusing_an_older_duplicate_keeps_the_newer_ones_entry(name: str) -> None:
    reuse_an_older_duplicate(*IMPLS[name])


def test_the_case_catches_an_unguarded_delete(tmp_path: Path) -> None:
    mutant = mutants.allocator("R2UnguardedDelete", tmp_path)
    with pytest.raises(AssertionError):
        reuse_an_older_duplicate(mutant, lambda toks, bs: Sequence(toks, block_size=bs))
