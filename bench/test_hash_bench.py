"""What a block's hash costs under sha256 against xxh64 (R4), through the engine allocator.

Two measurements per hash and block size (16 and 256 tokens), each over fresh sequences
built in ``setup``, outside the timed region (a sequence caches its hash chain, so a round
that reused sequences would time nothing):

* ``chain``: ``hash_chain`` over sequences whose blocks are already packed: the hash
  and the loop around it, nothing else;
* ``can_allocate``: admission's lookup on an empty cache, what the scheduler pays for a
  new prompt: packing, hashing and the map probes.

The figure is nanoseconds per block (``extra_info``: ``ns_per_block_min`` and
``_median``); the sha256/xxh64 ratio is the one to read, within one run.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence

NUM_SEQS = 32
BLOCKS_PER_SEQ = 64  # looked up: the sequences hold one token more, a partial last block
ROUNDS = 20

CASES = [
    pytest.param(
        what,
        bs,
        alg,
        id=f"{what}-bs{bs}-{alg}",
        marks=pytest.mark.benchmark(group=f"{what}-bs{bs}"),
    )
    for what in ("chain", "can_allocate")
    for bs in (16, 256)
    for alg in ("xxh64", "sha256")
]


def _fresh(block_size: int, algorithm: str, pack: bool) -> tuple[BlockManager, list[Sequence]]:
    bm = BlockManager(NUM_SEQS * (BLOCKS_PER_SEQ + 1), block_size, hash_algorithm=algorithm)
    n = BLOCKS_PER_SEQ * block_size + 1
    seqs = [
        Sequence([(i * 7919 + s * 104_729) % 150_000 for i in range(n)], block_size=block_size)
        for s in range(NUM_SEQS)
    ]
    if pack:  # as hash_chain packs them (int64 LE, one bytes object per block)
        block = struct.Struct(f"<{block_size}q")
        for seq in seqs:
            tokens = seq.token_ids
            seq.block_bytes[:] = [
                block.pack(*tokens[i * block_size : (i + 1) * block_size])
                for i in range(BLOCKS_PER_SEQ)
            ]
    return bm, seqs


def _chain(bm: BlockManager, seqs: list[Sequence]) -> None:
    for seq in seqs:
        bm.hash_chain(seq, BLOCKS_PER_SEQ)


def _can_allocate(bm: BlockManager, seqs: list[Sequence]) -> None:
    for seq in seqs:
        if bm.can_allocate(seq) != 0:
            raise AssertionError("a fresh sequence hit an empty cache")


@pytest.mark.parametrize(("what", "block_size", "algorithm"), CASES)
def test_hash_cost(benchmark: Any, what: str, block_size: int, algorithm: str) -> None:
    sides: list[tuple[BlockManager, list[Sequence]]] = []

    def setup() -> tuple[tuple[BlockManager, list[Sequence]], dict[str, Any]]:
        sides.append(_fresh(block_size, algorithm, pack=what == "chain"))
        return sides[-1], {}

    run = _chain if what == "chain" else _can_allocate
    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    # Every round hashed every block of every sequence, at the algorithm's width.
    width = 64 if algorithm == "xxh64" else 256
    for _, seqs in sides:
        for seq in seqs:
            assert len(seq.block_hashes) == BLOCKS_PER_SEQ
            assert max(h.bit_length() for h in seq.block_hashes) > width - 16

    blocks = NUM_SEQS * BLOCKS_PER_SEQ
    info = benchmark.extra_info
    info.update(suite="hash", what=what, block_size=block_size, algorithm=algorithm)
    timings = benchmark.stats  # None under --benchmark-disable
    if timings is not None:
        for key in ("min", "median"):
            info[f"ns_per_block_{key}"] = getattr(timings.stats, key) / blocks * 1e9
