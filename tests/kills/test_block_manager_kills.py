"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/block_manager.py
(the earlier ones live in test_block_pool_kills.py and test_allocator_kills.py).

Each section names what it kills. Expected hashes are R4 written out by hand with xxhash
(docs/design.md, "Allocator rules"), never taken from the allocator; refusals are checked
for their exact message and for leaving the allocator and the sequence as they were.
"""

from __future__ import annotations

import struct

import pytest
import xxhash

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence


def _r4(tokens: tuple[int, ...], prefix: int | None) -> int:
    head = b"" if prefix is None else prefix.to_bytes(8, "little")
    return xxhash.xxh64(head + struct.pack(f"<{len(tokens)}q", *tokens)).intdigest()


def _prefilled(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence allocated and prefilled in one step (its blocks registered), then its
    step committed as the scheduler does."""
    seq = Sequence(tokens, block_size=bm.block_size)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)
    seq.num_scheduled_tokens = len(tokens)
    bm.hash_blocks(seq)
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(tokens), 0
    return seq


def _state(bm: BlockManager, seq: Sequence) -> tuple[object, ...]:
    return (
        bm.snapshot(),
        list(seq.block_table),
        list(seq.block_hashes),
        list(seq.block_bytes),
        seq.num_cached_tokens,
        seq.num_scheduled_tokens,
    )


# --------------------------------------------------------------------------------------------
# One hash_blocks call that fills two blocks past ones already hashed (a step of 8 tokens
# after a prefill): kills xǁBlockManagerǁhash_blocks__mutmut_35 and 36 (the decode step's
# one-block inlined path taken for two blocks, registering only the first).
# --------------------------------------------------------------------------------------------


def test_a_step_that_fills_two_blocks_registers_both_along_the_chain() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _prefilled(bm, list(range(1, 10)))  # blocks 0, 1 full and registered
    for token in range(10, 18):  # tokens 10..17: blocks 2 and 3 fill, 17 starts block 4
        seq.append_token(token)
        bm.may_append(seq)
    seq.num_scheduled_tokens = 8  # one step computes all eight
    bm.hash_blocks(seq)
    h0 = _r4((1, 2, 3, 4), None)
    h1 = _r4((5, 6, 7, 8), h0)
    h2 = _r4((9, 10, 11, 12), h1)
    h3 = _r4((13, 14, 15, 16), h2)
    state = bm.snapshot()
    table = seq.block_table
    assert [state.block_hashes[b] for b in table] == [h0, h1, h2, h3, None]
    assert dict(state.hash_to_block) == {h0: table[0], h1: table[1], h2: table[2], h3: table[3]}
    assert [state.block_tokens[b] for b in table[2:4]] == [(9, 10, 11, 12), (13, 14, 15, 16)]
    bm.check_invariants([seq])


# --------------------------------------------------------------------------------------------
# hash_blocks' refusals: kills xǁBlockManagerǁhash_blocks__mutmut_19 (a negative cached count
# let through), 22 (a step of no tokens refused as outside the sequence) and 26 (no message).
# --------------------------------------------------------------------------------------------


def test_a_negative_cached_count_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _prefilled(bm, list(range(1, 10)))
    seq.num_cached_tokens, seq.num_scheduled_tokens = -4, 4
    before = _state(bm, seq)
    with pytest.raises(ValueError) as caught:
        bm.hash_blocks(seq)
    assert str(caught.value) == (
        "hash_blocks: num_cached_tokens=-4 + num_scheduled_tokens=4 is outside a 9-token sequence"
    )
    assert _state(bm, seq) == before


def test_more_full_blocks_than_the_table_holds_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _prefilled(bm, list(range(1, 10)))  # 3 blocks
    seq.block_table.pop()  # an inconsistent table: 2 blocks for 9 computed tokens
    seq.num_cached_tokens, seq.num_scheduled_tokens = 12, 0
    seq.append_token(10)
    seq.append_token(11)
    seq.append_token(12)
    before = _state(bm, seq)
    with pytest.raises(RuntimeError) as caught:
        bm.hash_blocks(seq)
    assert str(caught.value) == "hash_blocks: 3 full blocks but the sequence holds 2"
    assert _state(bm, seq) == before


# --------------------------------------------------------------------------------------------
# allocate's refusal of a sequence that holds blocks: kills xǁBlockManagerǁallocate__mutmut_2
# (the message padded).
# --------------------------------------------------------------------------------------------


def test_allocating_a_sequence_twice_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _prefilled(bm, list(range(1, 10)))
    before = _state(bm, seq)
    with pytest.raises(RuntimeError) as caught:
        bm.allocate(seq, 0)
    assert str(caught.value) == "allocate: the sequence already holds blocks"
    assert _state(bm, seq) == before


# --------------------------------------------------------------------------------------------
# allocate's refusal when the pool is short: kills xǁBlockManagerǁallocate__mutmut_10 (the
# message padded).
# --------------------------------------------------------------------------------------------


def test_allocating_past_the_free_blocks_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    held = _prefilled(bm, list(range(1, 6)))  # 2 of the 3 blocks
    seq = Sequence(list(range(100, 109)), block_size=4)  # needs 3
    assert bm.can_allocate(seq) is None
    before = (_state(bm, held), _state(bm, seq))
    with pytest.raises(RuntimeError) as caught:
        bm.allocate(seq, 0)
    assert str(caught.value) == "allocate: not enough free blocks for this sequence"
    assert (_state(bm, held), _state(bm, seq)) == before


# --------------------------------------------------------------------------------------------
# The remembered lookup (_hits' memo) is reused only for the same sequence in the same state:
# kills xǁBlockManagerǁ_hits__mutmut_9 (reused for another sequence of the same length) and
# 10 (its version compared with the token count, so a stale lookup is reused once the
# version reaches the sequence's length).
# --------------------------------------------------------------------------------------------


def test_a_remembered_lookup_is_not_reused_for_another_sequence() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    _prefilled(bm, [1, 2, 3, 4, 5, 6, 7, 8, 50])  # registers blocks [1..4], [5..8]
    sharing = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 99], block_size=4)
    other = Sequence([9, 9, 9, 9, 9, 9, 9, 9, 99], block_size=4)  # the same length
    assert bm.can_allocate(sharing) == 2
    assert bm.can_allocate(other) == 0
    assert bm.can_allocate(sharing) == 2


def test_a_remembered_lookup_is_not_reused_after_the_state_changed() -> None:
    # Only allocate looks up (and remembers); the changes after the lookup below go through
    # hash_blocks and deallocate, so the memo stays the late sequence's.
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 50], block_size=4)
    passers = [Sequence([200 + k], block_size=4) for k in range(3)]
    for seq in (first, *passers):
        bm.allocate(seq, 0)  # versions 1..4
    late = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 99], block_size=4)  # 9 tokens
    assert bm.can_allocate(late) == 0  # remembered at version 4: nothing registered yet
    first.num_scheduled_tokens = 9
    bm.hash_blocks(first)  # 5: blocks [1..4] and [5..8] registered
    for seq in (*passers, first):
        bm.deallocate(seq)  # 6..9: first's blocks freed, still registered (lazy eviction)
    assert bm._version == late.num_tokens == 9  # the coincidence mutant 10 needs
    assert bm.can_allocate(late) == 2  # both blocks revived from the free queue


# --------------------------------------------------------------------------------------------
# A later chunk registers only the blocks it filled: kills xǁBlockManagerǁhash_blocks__mutmut_67
# (the general path's loop from block 0, so a chunk registers its sequence's earlier blocks
# again and takes a hash back from a newer registration of the same tokens: R8, the newest
# registration wins).
# --------------------------------------------------------------------------------------------


def test_a_later_chunk_leaves_a_newer_registration_of_an_earlier_block_alone() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    chunked = Sequence(list(range(1, 13)), block_size=4)  # 3 blocks, prefilled in 2 chunks
    same_start = Sequence([1, 2, 3, 4, 50, 51, 52, 53], block_size=4)
    assert bm.can_allocate(chunked) == 0
    bm.allocate(chunked, 0)  # blocks 0, 1, 2
    assert bm.can_allocate(same_start) == 0  # nothing registered yet
    bm.allocate(same_start, 0)  # blocks 3, 4
    assert (chunked.block_table, same_start.block_table) == ([0, 1, 2], [3, 4])
    chunked.num_scheduled_tokens = 4
    bm.hash_blocks(chunked)  # block 0 registered for [1..4]
    chunked.num_cached_tokens, chunked.num_scheduled_tokens = 4, 0
    same_start.num_scheduled_tokens = 8
    bm.hash_blocks(same_start)  # block 3 for [1..4] now (newest wins), block 4 for [50..53]
    chunked.num_scheduled_tokens = 8  # two blocks at once: the general path, not the inlined
    bm.hash_blocks(chunked)  # blocks 1 and 2, and nothing else
    late = Sequence([1, 2, 3, 4, 7, 7, 7, 7, 8], block_size=4)
    assert bm.can_allocate(late) == 1
    bm.allocate(late, 1)
    assert late.block_table == [3, 5, 6]  # the hit is same_start's block, then the queue head
    assert bm.ref_counts[3] == 2 and bm.ref_counts[0] == 1
