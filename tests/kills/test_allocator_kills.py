"""Tests that kill mutants mutmut (tox -e mutation) found alive: the allocator, its hashing
and the sequence (engine/indexing.py, hashing.py, block_pool.py, sequence.py; spec twins).

Each section names what it kills. The expected values never come from the code under test:
they are computed by a second, deliberately naive procedure or written out by hand.
"""

from __future__ import annotations

import hashlib
import pickle
from types import ModuleType
from typing import Any

import pytest
from xxhash import xxh64_intdigest

import spec.indexing as spec_indexing
from paged_engine.engine import indexing as engine_indexing
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.hashing import sha256_block_hash as engine_sha256
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.sampling_params import SamplingParams
from spec.hashing import sha256_block_hash as spec_sha256
from spec.hashing import simple_block_hash

# --------------------------------------------------------------------------------------------
# Index arithmetic (engine/indexing.py, spec/indexing.py). Inside the fast selection only the
# allocator's calls reached these helpers, always with block-aligned arguments, and nothing
# reached slot_mapping (the model runner's) or the spec's twins (CrossHair's) at all.
# --------------------------------------------------------------------------------------------

INDEXING = pytest.mark.parametrize("mod", [engine_indexing, spec_indexing], ids=["engine", "spec"])


def filled_blocks(num_tokens: int, block_size: int) -> list[int]:
    """The token count of each block after appending ``num_tokens`` tokens one at a time."""
    fill: list[int] = []
    for _ in range(num_tokens):
        if not fill or fill[-1] == block_size:
            fill.append(0)
        fill[-1] += 1
    return fill


def token_positions(num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """(logical block, offset in it) of every token, by the same filling."""
    positions = []
    for n in range(1, num_tokens + 1):
        fill = filled_blocks(n, block_size)
        positions.append((len(fill) - 1, fill[-1] - 1))
    return positions


@INDEXING
@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_block_counts_match_filling_blocks_one_token_at_a_time(
    mod: ModuleType, block_size: int
) -> None:
    for num_tokens in range(0, 14):
        fill = filled_blocks(num_tokens, block_size)
        assert mod.num_blocks(num_tokens, block_size) == len(fill), num_tokens
        if num_tokens >= 1:
            assert mod.last_block_num_tokens(num_tokens, block_size) == fill[-1], num_tokens
            # R7: the newest token is alone in its block.
            assert mod.needs_new_block(num_tokens, block_size) == (fill[-1] == 1), num_tokens


def test_hand_written_block_counts() -> None:
    for mod in (engine_indexing, spec_indexing):
        assert [mod.num_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
        assert [mod.last_block_num_tokens(n, 4) for n in (1, 3, 4, 5, 8, 9)] == [1, 3, 4, 1, 4, 1]
        assert [mod.needs_new_block(n, 3) for n in (1, 2, 3, 4, 7)] == [
            True,
            False,
            False,
            True,
            True,
        ]


@INDEXING
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_slot_mapping_is_block_id_times_size_plus_offset_for_every_range(
    mod: ModuleType, block_size: int
) -> None:
    # Block ids out of order and far apart, so a wrong table index or offset shows.
    table = [7, 2, 9, 4]
    capacity = len(table) * block_size
    positions = token_positions(capacity, block_size)
    for start in range(capacity + 1):
        for end in range(start, capacity + 1):
            expected = [table[b] * block_size + off for b, off in positions[start:end]]
            assert mod.slot_mapping(table, block_size, start, end) == expected, (start, end)


def test_hand_written_slot_mapping() -> None:
    for mod in (engine_indexing, spec_indexing):
        # block size 4, table [5, 1]: block 5 holds slots 20-23, block 1 slots 4-7.
        assert mod.slot_mapping([5, 1], 4, 2, 7) == [22, 23, 4, 5, 6]
        assert mod.slot_mapping([5, 1], 4, 4, 8) == [4, 5, 6, 7]
        assert mod.slot_mapping([5, 1], 4, 3, 3) == []


# --------------------------------------------------------------------------------------------
# A Sequence pickled for a worker (engine/sequence.py __getstate__/__setstate__): nothing in
# the selection unpickled one. Every counter is distinct, so a swap shows.
# --------------------------------------------------------------------------------------------


def _pickled_sequence(decoding: bool) -> tuple[Sequence, Sequence]:
    seq = Sequence([11, 12, 13, 14, 15, 16, 17], block_size=3, seq_id=41)
    seq.block_table = [9, 4, 6]
    seq.num_cached_tokens = 5
    seq.num_scheduled_tokens = 2
    seq.status = SequenceStatus.RUNNING
    if decoding:
        seq.is_prefill = False
        seq.append_token(18)  # 8 tokens, 7 in the prompt
        seq.num_cached_tokens, seq.num_scheduled_tokens = 7, 1
    return seq, pickle.loads(pickle.dumps(seq))


@pytest.mark.parametrize("decoding", [False, True], ids=["prefill", "decode"])
def test_a_pickled_sequence_carries_what_the_worker_reads(decoding: bool) -> None:
    seq, copy = _pickled_sequence(decoding)
    expected = {
        "seq_id": 41,
        "block_size": 3,
        "num_tokens": 8 if decoding else 7,
        "num_prompt_tokens": 7,
        "num_cached_tokens": 7 if decoding else 5,
        "num_scheduled_tokens": 1 if decoding else 2,
        "block_table": [9, 4, 6],
        "last_token": 18 if decoding else 17,
        "is_prefill": not decoding,
        "status": SequenceStatus.RUNNING,
        "num_prefix_hit_tokens": None,
        "block_hashes": [],
        "block_bytes": [],
        "cache_salt": None,
    }
    assert {name: getattr(copy, name) for name in expected} == expected
    # A prefill carries its tokens (the worker embeds them); a decode carries none.
    assert copy.token_ids == ([] if decoding else [11, 12, 13, 14, 15, 16, 17])
    assert copy.sampling_params == SamplingParams()
    assert seq.token_ids[-1] == copy.last_token


# --------------------------------------------------------------------------------------------
# R6 in allocate: a hit in use is shared (its count grows), a hit in the free queue is revived
# from wherever it stands (not from the head). States worked out by hand from the traffic.
# --------------------------------------------------------------------------------------------


def _xxh64_chain(*blocks: tuple[int, ...]) -> list[int]:
    """R4 by hand: xxh64 over the previous hash (8 bytes LE) and the int64 LE tokens."""
    out: list[int] = []
    for tokens in blocks:
        head = out[-1].to_bytes(8, "little") if out else b""
        body = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
        out.append(xxh64_intdigest(head + body))
    return out


def test_hits_are_shared_in_use_and_revived_from_the_middle_of_the_queue() -> None:
    bm = BlockManager(8, 2)

    def admit(tokens: list[int]) -> Sequence:
        seq = Sequence(tokens, block_size=2)
        bm.allocate(seq, bm.can_allocate(seq) or 0)
        seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
        bm.hash_blocks(seq)
        seq.num_cached_tokens = len(seq)
        return seq

    h0, h1 = _xxh64_chain((1, 2), (3, 4))
    (g0,) = _xxh64_chain((7, 7))
    a = admit([1, 2, 3, 4, 5])  # fresh 0, 1, 2; blocks 0 and 1 registered
    b = admit([1, 2, 3, 4, 6])  # shares 0 and 1 (in use), fresh 3
    assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3])
    assert b.num_cached_tokens == 5 and bm.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0]
    other = admit([7, 7, 7])  # fresh 4, 5; block 4 registered
    for seq in (a, b, other):
        bm.deallocate(seq)  # each table last block first (R3)
    assert tuple(bm.free_blocks) == (6, 7, 2, 3, 1, 0, 5, 4)
    c = admit([1, 2, 3, 4, 9])  # revives 0 and 1 from the queue's middle, fresh 6 (its head)
    assert c.block_table == [0, 1, 6]
    state = bm.snapshot()
    assert state.free_queue == (7, 2, 3, 5, 4)
    assert state.ref_counts == (1, 1, 0, 0, 0, 0, 1, 0)
    assert dict(state.hash_to_block) == {h0: 0, h1: 1, g0: 4}
    bm.check_invariants([c])


# --------------------------------------------------------------------------------------------
# spec.hashing.simple_block_hash, CrossHair's stand-in for xxh64: only CrossHair called it.
# Pinned values worked out by hand from its definition (h0 = prefix + 1 or 0, then
# h = (h * 1000003 + token + 1) mod 2**64), and its contract: 64 bits, chained.
# --------------------------------------------------------------------------------------------


def test_the_crosshair_stand_in_hash() -> None:
    assert simple_block_hash((0,), None) == 1
    assert simple_block_hash((1, 2), None) == 2 * 1_000_003 + 3
    assert simple_block_hash((0,), 5) == 6 * 1_000_003 + 1
    assert simple_block_hash((0,), 0) == 1_000_003 + 1  # prefix 0 is not "no prefix"
    top = 2**64 - 1
    # (2**64 - 1) * 1000003 + 1 == -1000003 + 1 (mod 2**64)
    assert simple_block_hash((0,), top - 1) == 2**64 - 1_000_002
    assert 0 <= simple_block_hash((top, top), top - 1) < 2**64
    # 2**63 * 1000003 == 2**63 (mod 2**64, the multiplier is odd), but 3 * 2**63 mod 2**65.
    assert simple_block_hash((0,), 2**63 - 1) == 2**63 + 1


# --------------------------------------------------------------------------------------------
# R4 under sha256 (engine/hashing.py, spec/hashing.py): the selection hashed only with xxh64,
# and sha256 requests only at block 0 (no prefix). The oracle is hashlib over the documented
# bytes: the previous digest as 32 big-endian bytes, then int64 little-endian tokens.
# --------------------------------------------------------------------------------------------


def documented_sha256(tokens: tuple[int, ...], prefix: int | None) -> int:
    data = b"" if prefix is None else prefix.to_bytes(32, "big")
    data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


@pytest.mark.parametrize("fn", [engine_sha256, spec_sha256], ids=["engine", "spec"])
def test_sha256_chain_is_the_documented_bytes(fn: Any) -> None:
    block0 = fn((5, -1, 2**40), None)
    assert block0 == documented_sha256((5, -1, 2**40), None)
    assert block0 >= 2**200  # the whole 256-bit digest (this one's top byte is not 0)
    block1 = fn((7, 8, 9), block0)
    assert block1 == documented_sha256((7, 8, 9), block0)
    assert fn((7, 8, 9), 1) == documented_sha256((7, 8, 9), 1)
