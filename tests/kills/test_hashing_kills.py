"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/hashing.py (the
earlier ones live in test_allocator_kills.py).

Each section names what it kills. Expected hashes and packed bytes are R4 written out by
hand with xxhash and struct (docs/design.md), never taken from the hasher.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import xxhash

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence

# Past the grouper's limit (hashing._GROUPER_MAX_BLOCK_SIZE = 64): blocks are packed one
# slice each, the path the selection's small blocks never took with more than one block.
BS = 65


def _pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _chain(tokens: list[int], n: int) -> list[int]:
    """R4 by hand over the first ``n`` full blocks, no salt."""
    out: list[int] = []
    for i in range(n):
        head = b"" if not out else out[-1].to_bytes(8, "little")
        out.append(xxhash.xxh64(head + _pack(tokens[i * BS : (i + 1) * BS])).intdigest())
    return out


def _outcome(f: Callable[..., Any], *args: Any) -> Any:
    """What a call returns, or the type of what it raised: a wrong answer either way."""
    try:
        return f(*args)
    except Exception as e:
        return type(e)


# --------------------------------------------------------------------------------------------
# A lookup over a sequence whose last block is one token short: kills
# xǁBlockHasherǁ_packed_blocks__mutmut_26 (the slice loop's bound one too far: it packs the
# partial block too, and struct refuses it; the packing is hash_chain's now).
# --------------------------------------------------------------------------------------------


def test_a_lookup_packs_and_hashes_only_the_full_blocks() -> None:
    tokens = list(range(1, 3 * BS))  # 3 * BS - 1 tokens: two full blocks, one short
    seq = Sequence(tokens, block_size=BS)
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert _outcome(bm.can_allocate, seq) == 0
    assert seq.block_bytes == [_pack(tokens[:BS]), _pack(tokens[BS : 2 * BS])]
    assert seq.block_hashes == _chain(tokens, 2)


# --------------------------------------------------------------------------------------------
# A step that fills two blocks after one packed earlier: kills
# xǁBlockHasherǁ_packed_blocks__mutmut_24 (the bound one block short) and 27 (the new blocks
# rebound to a fresh list, so the sequence's cache keeps only the first).
# --------------------------------------------------------------------------------------------


def test_two_blocks_filled_in_one_step_are_packed_after_the_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(1, BS + 2))  # BS + 1 tokens: block 0 full
    seq = Sequence(tokens, block_size=BS)
    assert bm.can_allocate(seq) == 0
    bm.allocate(seq, 0)
    seq.num_scheduled_tokens = len(tokens)
    bm.hash_blocks(seq)  # block 0 packed and registered
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(tokens), 0
    for token in range(BS + 2, 3 * BS + 2):  # 2 * BS more: blocks 1 and 2 fill
        seq.append_token(token)
        bm.may_append(seq)
        tokens.append(token)
    seq.num_scheduled_tokens = 2 * BS
    assert _outcome(bm.hash_blocks, seq) is None
    assert seq.block_bytes == [_pack(tokens[i * BS : (i + 1) * BS]) for i in range(3)]
    expected = _chain(tokens, 3)
    state = bm.snapshot()
    assert [state.block_hashes[b] for b in seq.block_table[:3]] == expected
    assert dict(state.hash_to_block) == dict(zip(expected, seq.block_table[:3], strict=True))
