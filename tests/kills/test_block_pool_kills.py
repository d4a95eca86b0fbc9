"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/block_pool.py,
block_manager.py and hashing.py (the run of this file's first version: see the report).

Every allocator the engine builds is a ``BlockManager``, which passes ``hash_algorithm``
itself, so nothing in the selection built a bare ``BlockPool`` or ``BlockHasher`` with its
own default, gave one a ``bool`` size, read a recycled block's ``block_tokens``, or
pinned a refusal's whole message. Expected values by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
from xxhash import xxh64_intdigest

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.block_pool import BlockPool
from paged_engine.engine.hashing import BlockHasher
from paged_engine.engine.sequence import Sequence

# ---- BlockPool.__init__: its own default hash (mutants 1, 2: "XXxxh64XX", "XXH64") --------


def test_a_bare_pool_hashes_with_xxh64_by_default() -> None:
    pool = BlockPool(4, 2)
    assert pool.hash_algorithm == "xxh64"
    seq = Sequence([1, 2, 3], block_size=2)
    # R4, block 0: xxh64 over the tokens as int64 little-endian, no prefix.
    expected = xxh64_intdigest((1).to_bytes(8, "little") + (2).to_bytes(8, "little"))
    assert pool.hash_chain(seq, 1) == [expected]


# ---- BlockPool.__init__: num_blocks validation (mutant 4: `or` -> `and` lets a bool in) ---


@pytest.mark.parametrize("cls", [BlockPool, BlockManager])
@pytest.mark.parametrize("num_blocks", [True, False, 4.0, "4", None])
def test_a_pool_size_that_is_not_an_int_is_refused(cls: Any, num_blocks: Any) -> None:
    with pytest.raises(ValueError, match=rf"^num_blocks must be an int >= 1, got {num_blocks!r}$"):
        cls(num_blocks, 4)


@pytest.mark.parametrize("block_size", [True, 2.0])
def test_a_block_size_that_is_not_an_int_is_refused(block_size: Any) -> None:
    with pytest.raises(ValueError, match=rf"^block_size must be an int >= 1, got {block_size!r}$"):
        BlockHasher(block_size)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockManager(4, block_size)


def test_the_smallest_pool_is_accepted() -> None:
    pool = BlockPool(1, 1)
    assert (pool.num_blocks, pool.num_free_blocks, pool.ref_counts) == (1, 1, [0])


# ---- BlockPool._unregister: a recycled block's tokens are b"" (mutant 7: None) -----------


def test_a_recycled_block_keeps_no_hash_and_no_tokens() -> None:
    bm = BlockManager(1, 2)
    a = Sequence([1, 2], block_size=2)
    hits = bm.can_allocate(a)
    assert hits == 0
    bm.allocate(a, hits)
    a.num_scheduled_tokens = 2
    bm.hash_blocks(a)
    a.num_cached_tokens, a.num_scheduled_tokens = 2, 0
    bm.deallocate(a)
    assert bm.block_tokens[0] == (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    b = Sequence([3, 4], block_size=2)  # another prefix: block 0 is evicted (R2)
    hits = bm.can_allocate(b)
    assert hits == 0
    bm.allocate(b, hits)
    assert b.block_table == [0]
    assert bm.block_hashes[0] is None and bm.hash_to_block == {}
    assert bm.block_tokens[0] == b""  # "b'' when unset" (BlockPool.__init__), not None
    bm.check_invariants([b])


def test_a_bare_hasher_hashes_with_xxh64_by_default() -> None:
    hasher = BlockHasher(2)  # BlockHasher's own default (mutants 1, 2 of its __init__)
    assert hasher.hash_algorithm == "xxh64"
    expected = xxh64_intdigest((5).to_bytes(8, "little") + (6).to_bytes(8, "little"))
    assert hasher.hash_chain(Sequence([5, 6], block_size=2), 1) == [expected]


# ---- check_invariants: the exact messages, and the pool's upper end ----------------------
# tests/test_invariants.py matches each clause's message with re.search; these pin the
# whole message (a mutant that pads it survives a search) and put the stray id exactly at
# num_blocks, the first id outside the pool (mutant 42: `b <= n` accepts it).


def _one_block_in_use() -> tuple[BlockManager, Sequence]:
    bm = BlockManager(4, 2)
    seq = Sequence([1], block_size=2)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)
    assert seq.block_table == [0]
    bm.check_invariants([seq])
    return bm, seq


def test_a_queued_id_past_the_pool_fails_with_its_message() -> None:
    bm, seq = _one_block_in_use()
    bm.free_blocks[4] = None
    with pytest.raises(AssertionError) as caught:
        bm.check_invariants([seq])
    assert str(caught.value) == "free queue holds an id outside the pool"


@pytest.mark.parametrize("stray", [4, -1])
def test_a_table_holding_an_id_outside_the_pool_fails_with_its_message(stray: int) -> None:
    bm, seq = _one_block_in_use()
    held = Sequence([1], block_size=2)
    held.block_table = [stray]
    with pytest.raises(AssertionError) as caught:
        bm.check_invariants([seq, held])
    assert str(caught.value) == f"{held} holds block {stray}, outside the pool"


# ---- fresh blocks from the queue head, and a decode step's one filled block --------------
# (once mutants 18 and 21 of BlockManager.__init__, which chose between hooks and their
# inlined copies: there is one implementation now). Expected values by hand.


def test_prefill_a_decode_step_that_fills_a_block_and_one_that_starts_one() -> None:
    bm = BlockManager(4, 2)
    seq = Sequence([1, 2, 3], block_size=2)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)  # fresh blocks 0 and 1, from the queue head
    seq.num_scheduled_tokens = 3
    bm.hash_blocks(seq)  # prefill: block 0 becomes full
    seq.num_cached_tokens, seq.num_scheduled_tokens = 3, 0
    seq.append_token(4)  # a decode step fills block 1
    bm.may_append(seq)
    seq.num_scheduled_tokens = 1
    bm.hash_blocks(seq)
    seq.num_cached_tokens, seq.num_scheduled_tokens = 4, 0
    seq.append_token(5)  # starts block 2: may_append takes the queue head
    bm.may_append(seq)
    bm.check_invariants([seq])
    h0 = xxh64_intdigest((1).to_bytes(8, "little") + (2).to_bytes(8, "little"))
    h1 = xxh64_intdigest(
        h0.to_bytes(8, "little") + (3).to_bytes(8, "little") + (4).to_bytes(8, "little")
    )
    state = bm.snapshot()
    assert seq.block_table == [0, 1, 2] and state.free_queue == (3,)
    assert seq.block_hashes == [h0, h1]
    assert state.block_hashes == (h0, h1, None, None)
    assert state.block_tokens == ((1, 2), (3, 4), (), ())
    assert dict(state.hash_to_block) == {h0: 0, h1: 1}


# ---- BlockManager.may_append: the refusal's exact message (mutant 22 pads it) -------------


def test_may_append_without_a_free_block_names_it_and_changes_nothing() -> None:
    bm = BlockManager(1, 2)
    seq = Sequence([1, 2], block_size=2)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)
    seq.append_token(3)  # starts block 1; the pool's one block is taken
    before = (bm.snapshot(), list(seq.block_table))
    with pytest.raises(RuntimeError) as caught:
        bm.may_append(seq)
    assert str(caught.value) == "may_append: no free block"
    assert (bm.snapshot(), list(seq.block_table)) == before


def test_may_append_on_a_sequence_without_blocks_names_it_and_changes_nothing() -> None:
    bm = BlockManager(2, 2)
    seq = Sequence([1, 2, 3], block_size=2)  # never allocated (mutants 25-28)
    before = bm.snapshot()
    with pytest.raises(RuntimeError) as caught:
        bm.may_append(seq)
    assert str(caught.value) == "may_append: the sequence holds no blocks"
    assert bm.snapshot() == before and seq.block_table == []


def test_may_append_two_tokens_past_the_table_names_it_and_changes_nothing() -> None:
    bm = BlockManager(4, 2)
    seq = Sequence([1, 2], block_size=2)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)
    seq.append_token(3)
    seq.append_token(4)  # a step skipped: block 1 was never asked for (mutants 29, 30)
    before = bm.snapshot()
    with pytest.raises(RuntimeError) as caught:
        bm.may_append(seq)
    expected = "may_append: a 4-token sequence with 1 blocks is not one token past its block table"
    assert str(caught.value) == expected
    assert bm.snapshot() == before and seq.block_table == [0]


def test_a_double_release_names_it_and_changes_nothing() -> None:
    bm = BlockManager(2, 2)
    seq = Sequence([1, 2, 3], block_size=2)
    bm.allocate(seq, 0)
    bm.deallocate(seq)
    before = bm.snapshot()
    with pytest.raises(RuntimeError) as caught:
        bm.deallocate(seq)  # deallocate mutant 4 pads the message
    assert str(caught.value) == "deallocate: the sequence holds no blocks (double release?)"
    assert bm.snapshot() == before
