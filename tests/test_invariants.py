"""R12 clause by clause: each checker fails on the corruption each clause forbids.

R12 (docs/design.md, "Allocator rules"): (a) the free queue and the used set partition
the pool with no duplicates; (b) ``ref_count == 0`` exactly for blocks in the free queue;
(c) with ``seqs``, each block's ``ref_count`` is the number of tables holding it; (d)
every map entry ``h -> b`` has ``block_hashes[b] == h``; (e) every block with
``ref_count > 1`` is full and hashed.

Three checkers state it: the engine's ``BlockPool.check_invariants``, the spec's
``BlockManager.check_invariants``, and the spec class's ``inv:`` lines (what CrossHair
checks after every public method). Each corruption below is built on a state reached by
real traffic (shared prefix blocks, a partial block, freed blocks still registered) and
breaks the clause it is listed under, leaving (c), (d) and (e) holding where it is not
about them. Each is checked against the message of the check that must fire first, so a
checker missing that check fails the test even when a later check trips over the same
state. (A queue entry that breaks (b) also breaks the spec's partition, which it checks
first: there the expected message is the partition's.) The uncorrupted twin passes.

The last section kills the remembered-lookup mutant (``can_allocate``'s memo not keyed
on the sequence's length).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.sequence import SpecSequence
from tests import allocator_mutants

BLOCK_SIZE = 2
POOL = 8
Seq = Any  # Sequence or SpecSequence
Allocator = Any  # BlockManager or SpecBlockManager


def _prefill(bm: Allocator, seq: Seq) -> None:
    hits = bm.can_allocate(seq)
    assert hits is not None
    bm.allocate(seq, hits)
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    bm.hash_blocks(seq)
    seq.num_cached_tokens += seq.num_scheduled_tokens
    seq.num_scheduled_tokens = 0


def build(side: str) -> tuple[Allocator, list[Seq]]:
    """Blocks 0-1 shared by A and B (full, hashed, ref 2); 2 and 3 their partial last
    blocks; C's blocks 4 (registered) and 5 freed to the tail (lazily kept). Free queue
    6, 7, 5, 4; hash map: blocks 0, 1 and 4."""
    if side == "engine":
        bm: Allocator = BlockManager(POOL, BLOCK_SIZE)

        def make(t: list[int]) -> Seq:
            return Sequence(t, block_size=BLOCK_SIZE)
    else:
        bm = SpecBlockManager(POOL, BLOCK_SIZE)

        def make(t: list[int]) -> Seq:
            return SpecSequence(list(t), BLOCK_SIZE)

    a, b, c = make([1, 2, 3, 4, 5]), make([1, 2, 3, 4, 9]), make([7, 7, 8])
    for seq in (a, b, c):
        _prefill(bm, seq)
    bm.deallocate(c)
    assert list(bm.ref_counts) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert [i for i, h in enumerate(bm.block_hashes) if h is not None] == [0, 1, 4]
    assert list(bm.free_blocks if side == "engine" else bm.free_queue) == [6, 7, 5, 4]
    return bm, [a, b]


# ---- corruptions: each takes (allocator, live seqs) and breaks one clause ------------------


def _queue_add(bm: Allocator, block: int) -> None:
    if isinstance(bm, BlockManager):
        bm.free_blocks[block] = None
    else:
        bm.free_queue.append(block)


def _queue_remove(bm: Allocator, block: int) -> None:
    if isinstance(bm, BlockManager):
        del bm.free_blocks[block]
    else:
        bm.free_queue.remove(block)


def _truncate_tokens(bm: Allocator, block: int) -> None:
    tokens = bm.block_tokens[block]
    one = 8 if isinstance(tokens, bytes) else 1  # the engine packs int64s
    bm.block_tokens[block] = tokens[:one]


def _unhash_shared(bm: Allocator, seqs: list[Seq]) -> None:
    h = bm.block_hashes[0]
    bm.block_hashes[0] = None
    del bm.hash_to_block[h]  # no entry left behind: only (e) is broken


def _map_to_unhashed(bm: Allocator, seqs: list[Seq]) -> None:
    bm.hash_to_block[12345] = 3  # B's partial block, never registered


def _map_to_other_block(bm: Allocator, seqs: list[Seq]) -> None:
    bm.hash_to_block[bm.block_hashes[4]] = 1  # block 1 holds another hash


def _stale_map_entry(bm: Allocator, seqs: list[Seq]) -> None:
    bm.block_hashes[4] = None  # as if reused without its entry dropped (R2)
    bm.block_tokens[4] = b"" if isinstance(bm, BlockManager) else ()


def _negative_ref_in_queue(bm: Allocator, seqs: list[Seq]) -> None:
    bm.ref_counts[6] = -1


def _negative_ref_unqueued(bm: Allocator, seqs: list[Seq]) -> None:
    _queue_remove(bm, 5)
    bm.ref_counts[5] = -1  # neither free (ref 0) nor in use (ref > 0)


@dataclass(frozen=True)
class Corruption:
    name: str
    clause: str
    corrupt: Callable[[Allocator, list[Seq]], None]
    engine: str | None
    """The message of the engine check that must fire; None where the engine's
    structure cannot hold the state (its free queue is a dict: no duplicates)."""
    spec: str
    """The same for the spec's ``check_invariants``."""
    inv: bool = True
    """Whether the spec's ``inv:`` lines state this clause (see test_inv_lines_...)."""


PARTITION = "do not partition the pool"
CORRUPTIONS = [
    Corruption(
        "id outside the pool queued",
        "a",
        lambda bm, s: _queue_add(bm, POOL),
        "free queue holds an id outside the pool",
        PARTITION,
    ),
    Corruption(
        "negative id queued",
        "a",
        lambda bm, s: _queue_add(bm, -1),
        "free queue holds an id outside the pool",
        PARTITION,
    ),
    Corruption(
        "free block queued twice",
        "a",
        lambda bm, s: bm.free_queue.append(6),
        None,
        PARTITION,
    ),
    Corruption(
        "block in use also queued",
        "b",
        lambda bm, s: _queue_add(bm, 2),
        r"block 2: ref_count 1 but in free queue: True",
        PARTITION,  # the spec's partition check sees it first (block 2 twice)
    ),
    Corruption(
        "free block missing from the queue",
        "b",
        lambda bm, s: _queue_remove(bm, 5),
        r"block 5: ref_count 0 but in free queue: False",
        PARTITION,
    ),
    Corruption(
        "negative ref count, queued",
        "b",
        _negative_ref_in_queue,
        r"block 6: ref_count -1 but in free queue: True",
        r"block 6: ref_count 0 must mean in the free queue",
    ),
    Corruption(
        "negative ref count, not queued",
        "b",
        _negative_ref_unqueued,
        r"block 5: ref_count -1 but in free queue: False",
        PARTITION,
    ),
    Corruption(
        "ref count above the holders",
        "c",
        lambda bm, s: bm.ref_counts.__setitem__(0, 3),
        r"ref counts \[3, 2, 1, 1, 0, 0, 0, 0\] != table holders \[2, 2",
        r"ref counts \[3, 2, 1, 1, 0, 0, 0, 0\] != table holders \[2, 2",
        inv=False,  # holders are not a class invariant: they need the sequences
    ),
    Corruption(
        "ref count below the holders",
        "c",
        lambda bm, s: bm.ref_counts.__setitem__(1, 1),
        r"ref counts \[2, 1, 1, 1, 0, 0, 0, 0\] != table holders \[2, 2",
        r"ref counts \[2, 1, 1, 1, 0, 0, 0, 0\] != table holders \[2, 2",
        inv=False,
    ),
    Corruption(
        "a table holds a free block",
        "c",
        lambda bm, s: s[1].block_table.append(5),
        r"!= table holders \[2, 2, 1, 1, 0, 1, 0, 0\]",
        r"!= table holders \[2, 2, 1, 1, 0, 1, 0, 0\]",
        inv=False,
    ),
    Corruption(
        "map entry to an unhashed block",
        "d",
        _map_to_unhashed,
        "hash map entry 12345 -> 3 disagrees with the block",
        "hash map entry 12345 -> 3 disagrees with the block",
    ),
    Corruption(
        "map entry to a block with another hash",
        "d",
        _map_to_other_block,
        r"hash map entry \d+ -> 1 disagrees with the block",
        r"hash map entry \d+ -> 1 disagrees with the block",
    ),
    Corruption(
        "map entry left for a reused block",
        "d",
        _stale_map_entry,
        r"hash map entry \d+ -> 4 disagrees with the block",
        r"hash map entry \d+ -> 4 disagrees with the block",
    ),
    Corruption(
        "shared block unhashed",
        "e",
        _unhash_shared,
        r"block 0 is shared but not full and hashed",
        r"block 0 is shared but not full and hashed",
    ),
    Corruption(
        "shared block hashed but not full",
        "e",
        lambda bm, s: _truncate_tokens(bm, 1),
        r"block 1 is shared but not full and hashed",
        r"block 1 is shared but not full and hashed",
        inv=False,  # the spec's inv: line says "hashed" only (reported)
    ),
]


@pytest.mark.parametrize("side", ["engine", "spec"])
def test_the_uncorrupted_state_passes(side: str) -> None:
    bm, seqs = build(side)
    bm.check_invariants(seqs)
    bm.check_invariants()
    if side == "spec":
        assert all(inv_lines(bm).values())


CASES = [
    (case, side)
    for case in CORRUPTIONS
    for side in ("engine", "spec")
    # the engine's free queue is an ordered set: it cannot hold a duplicate
    if (case.engine if side == "engine" else case.spec) is not None
]


@pytest.mark.parametrize(
    ("case", "side"), CASES, ids=[f"{side}-R12{c.clause}-{c.name}" for c, side in CASES]
)
def test_check_invariants_fails_on_each_clause(case: Corruption, side: str) -> None:
    message = case.engine if side == "engine" else case.spec
    assert message is not None
    bm, seqs = build(side)
    bm.check_invariants(seqs)  # the twin passes...
    case.corrupt(bm, seqs)
    with pytest.raises(AssertionError, match=message):  # ...the corrupted state does not
        bm.check_invariants(seqs)
    if case.clause != "c":  # without seqs, every clause but the holders' is checked
        with pytest.raises(AssertionError, match=message):
            bm.check_invariants()


# ---- the spec's inv: lines -------------------------------------------------------------------


INV_LINE = re.compile(r"^\s*inv: (.+)$", re.MULTILINE)


def inv_lines(bm: SpecBlockManager) -> dict[str, bool]:
    """Each ``inv:`` line of the spec class's docstring, evaluated on ``bm``."""
    lines = INV_LINE.findall(SpecBlockManager.__doc__ or "")
    assert len(lines) == 4, lines
    return {line: bool(eval(line, {"self": bm})) for line in lines}


@pytest.mark.parametrize("case", [c for c in CORRUPTIONS if c.inv], ids=lambda c: c.name)
def test_inv_lines_fail_on_the_clauses_they_state(case: Corruption) -> None:
    bm, seqs = build("spec")
    case.corrupt(bm, seqs)
    results = inv_lines(bm)
    assert not all(results.values()), f"every inv: line holds after '{case.name}'"


# ---- known holes: out-of-pool ids in the map or a table are not reported as R12 --------------


def _map_out_of_pool(bm: Allocator, seqs: list[Seq]) -> None:
    bm.hash_to_block[777] = POOL


def _map_negative(bm: Allocator, seqs: list[Seq]) -> None:
    # -POOL indexes block 0 from the end, whose hash the entry repeats: it passes the
    # comparison although no block -8 exists
    bm.hash_to_block[bm.block_hashes[0]] = -POOL


@pytest.mark.parametrize("side", ["engine", "spec"])
@pytest.mark.parametrize("corrupt", [_map_out_of_pool, _map_negative], ids=["past", "negative"])
def test_a_map_entry_naming_no_block_fails_the_check(
    side: str, corrupt: Callable[[Allocator, list[Seq]], None]
) -> None:
    bm, seqs = build(side)
    corrupt(bm, seqs)
    with pytest.raises(AssertionError, match="hash map entry"):
        bm.check_invariants(seqs)


# ---- the remembered lookup -----------------------------------------------------------------


def _grow(seq: Seq, tokens: list[int]) -> None:
    for t in tokens:
        if isinstance(seq, Sequence):
            seq.append_token(t)
        else:
            seq.token_ids.append(t)


def lookups_across_growth(engine_cls: type[BlockManager]) -> list[tuple[Any, Any]]:
    """(spec, engine) answers of ``can_allocate`` for sequences that grow between two
    calls, with no allocator call between them (so the state version does not move)."""
    answers = []
    # (1) the hits change: block [1, 2] is cached; [1] has nothing to look up, [1, 2, 3]
    # looks up block 0 and hits it.
    spec, engine = SpecBlockManager(4, 2), engine_cls(4, 2)
    _prefill(spec, SpecSequence([1, 2, 3], 2))
    _prefill(engine, Sequence([1, 2, 3], block_size=2))
    s, e = SpecSequence([1], 2), Sequence([1], block_size=2)
    answers.append((spec.can_allocate(s), engine.can_allocate(e)))
    _grow(s, [2, 3])
    _grow(e, [2, 3])
    answers.append((spec.can_allocate(s), engine.can_allocate(e)))
    # (2) the cost changes: 2 free blocks admit 4 tokens, not 5
    spec, engine = SpecBlockManager(2, 2), engine_cls(2, 2)
    s, e = SpecSequence([1, 2, 3], 2), Sequence([1, 2, 3], block_size=2)
    answers.append((spec.can_allocate(s), engine.can_allocate(e)))
    _grow(s, [4, 5])
    _grow(e, [4, 5])
    answers.append((spec.can_allocate(s), engine.can_allocate(e)))
    return answers


def check_lookups_across_growth(engine_cls: type[BlockManager]) -> None:
    answers = lookups_across_growth(engine_cls)
    assert [a[0] for a in answers] == [0, 1, 0, None]  # the spec: it remembers nothing
    for i, (spec_answer, engine_answer) in enumerate(answers):
        assert engine_answer == spec_answer, (
            f"lookup {i}: engine {engine_answer}, spec {spec_answer}"
        )


def test_a_sequence_that_grows_between_lookups_is_looked_up_again() -> None:
    check_lookups_across_growth(BlockManager)


@pytest.mark.source_patch
def test_the_memo_keyed_without_the_length_is_caught(tmp_path: Path) -> None:
    # The patch mutant (tests/allocator_mutants/MemoIgnoresLength.diff): can_allocate's
    # remembered lookup keyed on the sequence and the state version only, not on its
    # length. Lookup 1 gets the stale hits (0, not 1); lookup 3 the stale cost (0, not None).
    mutant = allocator_mutants.allocator("MemoIgnoresLength", tmp_path)
    with pytest.raises(AssertionError, match="lookup 1: engine 0, spec 1"):
        check_lookups_across_growth(mutant)
