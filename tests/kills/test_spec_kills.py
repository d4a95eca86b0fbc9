"""Tests that kill mutants mutmut (tox -e mutation) found alive in spec/ (a random sample of
its mutants was run: see scripts/mutation.py --sample).

Each section names what it kills; refusals are checked for their exact message and for
leaving the allocator and the sequence as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spec.block_manager import BlockManager
from spec.hashing import check_cache_salt
from spec.scheduler import Scheduler, SpecRequest
from spec.sequence import SpecSequence


def _allocated(bm: BlockManager, tokens: list[int]) -> SpecSequence:
    seq = SpecSequence(tokens, bm.block_size)
    hits = bm.can_allocate(seq)
    assert hits == 0
    bm.allocate(seq, hits)
    return seq


def _state(bm: BlockManager, seq: SpecSequence) -> tuple[object, ...]:
    return (bm.snapshot(), list(seq.block_table), seq.num_cached_tokens, seq.num_scheduled_tokens)


def _refused(
    bm: BlockManager,
    seq: SpecSequence,
    call: Callable[[], object],
    error: type[Exception],
    message: str,
) -> None:
    """``call`` raises ``error`` with exactly ``message`` and leaves the allocator and
    ``seq`` as they were."""
    before = _state(bm, seq)
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value) == message
    assert _state(bm, seq) == before


# --------------------------------------------------------------------------------------------
# The spec allocator's refusals (spec/block_manager.py): kills xǁBlockManagerǁhash_blocks__
# mutmut_3 (a negative cached count let through), may_append__mutmut_14 and 17 (messages).
# --------------------------------------------------------------------------------------------


def test_a_negative_cached_count_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _allocated(bm, [1, 2, 3])
    seq.num_cached_tokens, seq.num_scheduled_tokens = -2, 2
    _refused(
        bm,
        seq,
        lambda: bm.hash_blocks(seq),
        ValueError,
        "hash_blocks: num_cached_tokens=-2 + num_scheduled_tokens=2 is outside a 3-token sequence",
    )


def test_may_append_refusals_name_the_problem_and_change_nothing() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    seq = _allocated(bm, [1, 2])
    seq.token_ids.append(3)  # starts block 1; the pool's one block is taken
    _refused(bm, seq, lambda: bm.may_append(seq), RuntimeError, "may_append: no free block")
    seq.token_ids.append(4)
    seq.token_ids.append(5)  # two tokens past the table: a step was skipped
    _refused(
        bm,
        seq,
        lambda: bm.may_append(seq),
        RuntimeError,
        "may_append: a 5-token sequence with 1 blocks is not one token past its block table",
    )


# --------------------------------------------------------------------------------------------
# spec/hashing.py: kills x_check_cache_salt__mutmut_9 (the empty salt's message padded).
# --------------------------------------------------------------------------------------------


def test_an_empty_salt_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as caught:
        check_cache_salt("")
    assert str(caught.value) == "cache_salt must be a non-empty string"
    check_cache_salt("tenant")  # a salt, and no salt, are fine
    check_cache_salt(None)


# --------------------------------------------------------------------------------------------
# S5's deferral keys blocks by chained hash, not by tokens alone (spec/scheduler.py): kills
# xǁSchedulerǁ_chain__mutmut_13 (every hash None, so a request whose first block has the
# same tokens as another's second block would wait for it for nothing).
# --------------------------------------------------------------------------------------------


def test_a_block_with_the_same_tokens_under_another_prefix_is_not_waited_for() -> None:
    sched = Scheduler(
        BlockManager(num_blocks=16, block_size=4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    first = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seq_id="first")
    # Its block 0 holds the tokens of first's block 1, but with no prefix: another block.
    second = SpecRequest([5, 6, 7, 8, 20, 21, 22, 23, 24], 4, seq_id="second")
    sched.add(first)
    sched.add(second)
    batch, is_prefill = sched.schedule()
    assert [s.seq_id for s in batch] == ["first", "second"] and is_prefill


# --------------------------------------------------------------------------------------------
# More spec refusals: kills spec.block_manager xǁBlockManagerǁhash_blocks__mutmut_15 (more
# full blocks than the table holds, no message) and spec.scheduler xǁSchedulerǁschedule__
# mutmut_1 (a second schedule before postprocess, no message).
# --------------------------------------------------------------------------------------------


def test_more_full_blocks_than_the_table_holds_is_refused_by_name() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _allocated(bm, [1, 2, 3])  # 2 blocks
    seq.token_ids += [4, 5, 6]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 0, 6  # 3 full blocks
    _refused(
        bm,
        seq,
        lambda: bm.hash_blocks(seq),
        RuntimeError,
        "hash_blocks: 3 full blocks but the sequence holds 2",
    )


def test_a_second_schedule_before_postprocess_is_refused_by_name() -> None:
    sched = Scheduler(
        BlockManager(num_blocks=8, block_size=4),
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=32,
    )
    sched.add(SpecRequest([1, 2, 3], 4, seq_id="a"))
    sched.schedule()
    with pytest.raises(RuntimeError) as caught:
        sched.schedule()
    assert str(caught.value) == "schedule: the previous step was not post-processed or recovered"


# --------------------------------------------------------------------------------------------
# Sampled later: kills spec.block_manager xǁBlockManagerǁallocate__mutmut_2 and may_append__
# mutmut_4 (messages), and spec.scheduler xǁSchedulerǁ_schedule_prefill__mutmut_40 (the
# request after a deferred one skipped as well).
# --------------------------------------------------------------------------------------------


def test_allocating_twice_or_appending_without_blocks_is_refused_by_name() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _allocated(bm, [1, 2, 3])
    _refused(
        bm,
        seq,
        lambda: bm.allocate(seq, 0),
        RuntimeError,
        "allocate: the sequence already holds blocks",
    )
    bare = SpecSequence([1, 2, 3], 2)
    _refused(
        bm,
        bare,
        lambda: bm.may_append(bare),
        RuntimeError,
        "may_append: the sequence holds no blocks",
    )


def test_the_request_after_a_deferred_one_is_still_admitted() -> None:
    sched = Scheduler(
        BlockManager(num_blocks=16, block_size=4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    first = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seq_id="first")
    sharing = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 10], 4, seq_id="sharing")  # deferred
    other = SpecRequest([30, 31, 32, 33, 34], 4, seq_id="other")
    for seq in (first, sharing, other):
        sched.add(seq)
    batch, _ = sched.schedule()
    assert [s.seq_id for s in batch] == ["first", "other"]
    assert [s.seq_id for s in sched.waiting] == ["sharing"]


# --------------------------------------------------------------------------------------------
# A result that is neither a token nor a failed sample is refused by name: kills
# spec.scheduler xǁSchedulerǁpostprocess__mutmut_28 (the message None).
# --------------------------------------------------------------------------------------------


def test_a_result_that_is_no_token_is_refused_by_name() -> None:
    sched = Scheduler(
        BlockManager(num_blocks=8, block_size=4),
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=16,
    )
    sched.add(SpecRequest([1, 2, 3], 4, seq_id="s"))
    batch, _ = sched.schedule()
    with pytest.raises(RuntimeError) as caught:
        sched.postprocess(batch, ["x"])  # type: ignore[list-item]
    assert str(caught.value) == "the model returned 'x' for a sampling sequence"
