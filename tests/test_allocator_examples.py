"""Hand-written allocator cases: hand-worked examples, R4's exact bytes, the hash
cache, R13's reset, and every misuse refused with state left exactly as it was. Each case
runs on both the spec and the engine."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import xxhash

from paged_engine.engine.block_manager import BlockManager, xxh64_block_hash
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.sequence import SpecSequence

IMPLS = {
    "spec": (SpecBlockManager, lambda toks, bs: SpecSequence(list(toks), bs)),
    "engine": (BlockManager, lambda toks, bs: Sequence(toks, block_size=bs)),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return IMPLS[request.param]


def admit(bm: Any, seq: Any) -> int:
    hits = bm.can_allocate(seq)
    assert hits is not None
    bm.allocate(seq, hits)
    return hits


def compute_rest(bm: Any, seq: Any) -> None:
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    bm.hash_blocks(seq)
    seq.num_cached_tokens = len(seq)


def prefill(bm: Any, seq: Any) -> int:
    """Admit and compute a whole prompt in one step, as the scheduler would."""
    hits = admit(bm, seq)
    compute_rest(bm, seq)
    return hits


# ---- hand-worked examples ------------------------------------------------------


def test_600_token_shared_prefix_at_block_size_256_reuses_512(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(16, 256)
    prefix = [i % 1000 for i in range(600)]
    first = make(prefix + [7] * 50, 256)
    prefill(bm, first)
    second = make(prefix + [9] * 50, 256)
    assert admit(bm, second) == 2
    # Two full blocks hit; the other 88 shared tokens sit in block 2, whose content differs.
    assert second.num_cached_tokens == 512
    assert second.block_table[:2] == first.block_table[:2]


def test_identical_512_token_prompt_reuses_only_256(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(16, 256)
    prompt = list(range(512))
    first = make(prompt, 256)
    prefill(bm, first)
    second = make(prompt, 256)
    # The last block is never looked up (R5): prefill must compute at least one token.
    assert admit(bm, second) == 1
    assert second.num_cached_tokens == 256
    assert second.block_table == [first.block_table[0], 2]


def test_12_token_figure_block_size_4(impl: tuple[Any, Any]) -> None:
    """L0 hits block 1 in use, L1 revives block 3 from the free queue, the last block comes
    fresh from the queue head, block 6 (a hand-worked figure, rebuilt step by step)."""
    bm_cls, make = impl
    bm = bm_cls(8, 4)
    L0, L1, L2 = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    a = make([1, 1, 1, 1], 4)
    prefill(bm, a)  # -> [0]
    b = make([*L0, 5], 4)
    prefill(bm, b)  # -> [1, 2]; block 1 registered as L0
    c = make([*L0, *L1, 5], 4)
    assert prefill(bm, c) == 1  # L0 hits block 1 (in use) -> [1, 3, 4]; block 3 = L1
    assert c.block_table == [1, 3, 4]
    d = make([2, 2, 2, 2], 4)
    prefill(bm, d)  # -> [5]
    bm.deallocate(c)  # last first: 4 then 3 to the tail; block 1 still held by b
    assert bm.snapshot().free_queue == (6, 7, 4, 3)
    e = make([*L0, *L1, *L2], 4)
    assert bm.can_allocate(e) == 2
    bm.allocate(e, 2)
    assert e.block_table == [1, 3, 6]
    assert e.num_cached_tokens == 8
    state = bm.snapshot()
    assert state.ref_counts[1] == 2 and state.ref_counts[3] == 1
    assert state.free_queue == (7, 4)


def test_stale_registration_is_not_deleted_for_another_block(impl: tuple[Any, Any]) -> None:
    """R2 (nano-vllm #163): two blocks registered with one hash; the map points to the
    newer, so reusing the older must leave the entry alone."""
    bm_cls, make = impl
    bm = bm_cls(5, 2)
    x, y = make([1, 2, 9], 2), make([1, 2, 8], 2)
    for s in (x, y):  # admitted together, neither hits: both register [1, 2]
        assert bm.can_allocate(s) == 0
        bm.allocate(s, 0)
    for s in (x, y):
        s.num_scheduled_tokens = 3
        bm.hash_blocks(s)
        s.num_cached_tokens = 3
    h = bm.compute_hash([1, 2])
    assert dict(bm.snapshot().hash_to_block)[h] == 2  # y's block 2 overwrote x's block 0
    bm.deallocate(x)  # free queue: 4, 1, 0
    z = make([5, 5, 5, 5, 5], 2)
    admit(bm, z)  # reuses block 0, whose old hash now maps to block 2
    assert z.block_table == [4, 1, 0]
    assert dict(bm.snapshot().hash_to_block)[h] == 2
    bm.deallocate(z)
    w = make([1, 2, 7], 2)
    assert admit(bm, w) == 1
    assert w.block_table == [2, 0]


# ---- R4: the hash chain, bit for bit ---------------------------------------------------------


def _r4_formula(tokens: list[int], prefix: int | None) -> int:
    h = xxhash.xxh64()
    if prefix is not None:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


@pytest.mark.parametrize("tokens", [[0], [1, 2, 3, 4], list(range(256)), [2**40, 7, 2**63 - 1]])
@pytest.mark.parametrize("prefix", [None, 0, 12345, 2**64 - 1])
def test_hash_is_bit_identical_to_the_r4_formula(tokens: list[int], prefix: int | None) -> None:
    expected = _r4_formula(tokens, prefix)
    assert BlockManager.compute_hash(tokens, prefix) == expected
    assert SpecBlockManager.compute_hash(tokens, prefix) == expected
    assert xxh64_block_hash(tokens, prefix) == expected


def test_each_full_block_is_hashed_once_per_sequence_lifetime() -> None:
    calls: list[tuple[int, ...]] = []

    def counting(tokens: Any, prefix: int | None) -> int:
        calls.append(tuple(tokens))
        return xxh64_block_hash(tokens, prefix)

    bm = BlockManager(6, 4, hash_fn=counting)
    holder = Sequence(list(range(20)), block_size=4)  # 5 blocks: fills the pool
    prefill(bm, holder)
    assert len(calls) == 5
    seq = Sequence(list(range(100, 116)), block_size=4)  # 4 blocks, 3 looked up
    for _ in range(5):  # the scheduler retries every step while it waits
        assert bm.can_allocate(seq) is None
    bm.deallocate(holder)
    prefill(bm, seq)  # lookup, allocate, hash_blocks
    bm.deallocate(seq)  # preempted...
    prefill(bm, seq)  # ...and prefilled again
    assert len(calls) == 5 + 4  # each of its 4 full blocks once, whatever happened
    assert seq.num_cached_tokens == 16


def test_prefix_caching_off_registers_and_finds_nothing() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a, b = Sequence([1, 2, 3, 4, 5], block_size=2), Sequence([1, 2, 3, 4, 6], block_size=2)
    prefill(bm, a)
    assert prefill(bm, b) == 0
    assert bm.snapshot().hash_to_block == ()
    assert b.block_table == [3, 4, 5]


def test_pickled_decoding_sequence_carries_only_counters_table_and_last_token() -> None:
    seq = Sequence(list(range(4096)), block_size=16)
    seq.block_table = list(range(256))
    prefill_state = pickle.loads(pickle.dumps(seq))
    assert prefill_state.token_ids == seq.token_ids and prefill_state.is_prefill
    seq.is_prefill = False
    seq.append_token(7)
    blob = pickle.dumps(seq)
    back = pickle.loads(blob)
    assert len(blob) < 1200  # 4097 token ids would take over 8 KB
    assert back.token_ids == [] and back.last_token == 7 and len(back) == 4097
    assert back.block_table == seq.block_table and not back.is_prefill


# ---- R13: reset_prefix_cache -----------------------------------------------------------------


def test_reset_forgets_every_registration_and_keeps_the_free_queue(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(6, 2)
    a = make([1, 2, 3, 4, 5], 2)
    prefill(bm, a)  # blocks 0-2; 0 = [1, 2] and 1 = [3, 4] registered
    bm.deallocate(a)  # last first: the free queue is 3, 4, 5, 2, 1, 0
    b = make([1, 2, 3, 4, 6], 2)
    assert bm.can_allocate(b) == 2  # looked up, not admitted: the lookup is remembered
    assert bm.reset_prefix_cache() is True
    state = bm.snapshot()
    assert state.free_queue == (3, 4, 5, 2, 1, 0)
    assert state.hash_to_block == ()
    assert state.block_hashes == (None,) * 6 and state.block_tokens == ((),) * 6
    assert state.ref_counts == (0,) * 6
    # No hits, and fresh blocks from the head of the queue (without the reset: [0, 1, 3]).
    assert bm.can_allocate(b) == 0
    bm.allocate(b, 0)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0


def test_reset_while_a_sequence_holds_blocks_is_refused_and_changes_nothing(
    impl: tuple[Any, Any],
) -> None:
    bm_cls, make = impl
    bm = bm_cls(6, 2)
    a = make([1, 2, 3, 4, 5], 2)
    prefill(bm, a)  # blocks 0-2, held
    c = make([7, 7, 7], 2)
    prefill(bm, c)  # blocks 3 (registered [7, 7]) and 4
    bm.deallocate(c)  # a free block still registered: free queue 5, 4, 3
    before = bm.snapshot()
    assert bm.reset_prefix_cache() is False
    assert bm.snapshot() == before
    b = make([1, 2, 3, 4, 6], 2)
    assert prefill(bm, b) == 2 and b.block_table == [0, 1, 5]  # a's blocks still hit
    d = make([7, 7, 8], 2)
    assert prefill(bm, d) == 1 and d.block_table == [3, 4]  # and so does the free one
    for s in (a, b, d):
        bm.deallocate(s)
    assert bm.reset_prefix_cache() is True  # once every block is free
    assert bm.snapshot().hash_to_block == ()


# ---- misuse: a clear error, and nothing changed ----------------------------------------------


def _refused(bm: Any, seq: Any, call: Any, exc: type[Exception], words: str) -> None:
    before = (bm.snapshot(), list(seq.block_table), seq.num_cached_tokens)
    with pytest.raises(exc, match=words):
        call()
    assert (bm.snapshot(), list(seq.block_table), seq.num_cached_tokens) == before


@pytest.mark.parametrize("cls", [BlockManager, SpecBlockManager])
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "name"),
    [(0, 4, "num_blocks"), (-1, 4, "num_blocks"), (4, 0, "block_size")],
)
def test_non_positive_sizes_are_refused(
    cls: Any, num_blocks: int, block_size: int, name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        cls(num_blocks, block_size)


@pytest.mark.parametrize("tokens", [[], [1, -2, 3]])
def test_empty_or_negative_token_lists_are_refused(tokens: list[int]) -> None:
    with pytest.raises(ValueError, match="token"):
        Sequence(tokens)


def test_allocate_twice_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(8, 4)
    seq = make([1, 2, 3, 4, 5], 4)
    bm.allocate(seq, 0)
    _refused(bm, seq, lambda: bm.allocate(seq, 0), RuntimeError, "already holds blocks")


def test_allocate_with_a_hit_count_the_cache_does_not_hold_is_refused(
    impl: tuple[Any, Any],
) -> None:
    bm_cls, make = impl
    bm = bm_cls(8, 4)
    prefill(bm, make([1, 2, 3, 4, 5], 4))
    seq = make([1, 2, 3, 4, 6], 4)
    assert bm.can_allocate(seq) == 1
    for wrong in (0, 2):
        _refused(bm, seq, lambda w=wrong: bm.allocate(seq, w), ValueError, "num_cached_blocks")


def test_allocate_beyond_the_pool_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(2, 4)
    seq = make(list(range(9)), 4)  # 3 blocks
    assert bm.can_allocate(seq) is None
    _refused(bm, seq, lambda: bm.allocate(seq, 0), RuntimeError, "not enough free blocks")


def test_double_release_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(4, 4)
    seq = make([1, 2, 3], 4)
    bm.allocate(seq, 0)
    bm.deallocate(seq)
    _refused(bm, seq, lambda: bm.deallocate(seq), RuntimeError, "holds no blocks")


def test_may_append_without_a_free_block_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(1, 2)
    seq = make([1, 2], 2)
    prefill(bm, seq)
    seq.token_ids.append(3) if isinstance(seq, SpecSequence) else seq.append_token(3)
    assert bm.can_append(seq) is False
    _refused(bm, seq, lambda: bm.may_append(seq), RuntimeError, "no free block")


def test_hash_blocks_with_counters_beyond_the_sequence_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(4, 2)
    seq = make([1, 2, 3], 2)
    bm.allocate(seq, 0)
    seq.num_scheduled_tokens = 4
    _refused(bm, seq, lambda: bm.hash_blocks(seq), ValueError, "outside a 3-token sequence")


def test_a_sequence_with_another_block_size_is_refused(impl: tuple[Any, Any]) -> None:
    bm_cls, make = impl
    bm = bm_cls(8, 4)
    seq = make([1, 2, 3, 4, 5], 2)
    with pytest.raises(ValueError, match="block_size 2 != the allocator's 4"):
        bm.can_allocate(seq)
    _refused(bm, seq, lambda: bm.allocate(seq, 0), ValueError, "block_size 2")
