"""More tests that kill mutants mutmut (tox -e mutation) found alive in spec/: the reference
allocator (spec/block_manager.py) and the reference scheduler (spec/scheduler.py).

Each section names what it kills. Expected values are written out by hand from the rules
(the allocator's R1-R13, the spec scheduler's S1-S12 docstrings), never computed by the spec.
Refusal messages are checked where both twins say the same words: the allocator's in full
(the engine's ``BlockManager`` raises the identical strings; tests/test_invariants.py
matches them), a scheduler stall by the words both twins' messages start with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from spec.block_manager import BlockManager
from spec.records import SpecFailedSample
from spec.scheduler import Scheduler, SpecRequest
from spec.sequence import SpecSequence
from tests.kills.test_spec_kills import _allocated, _state


def _outcome(f: Callable[[], Any]) -> Any:
    """What a call returns, or the type and message of what it raised: a wrong answer
    either way, compared by the assertion (so a mutant that raises, or stops raising,
    fails a comparison rather than the test's harness)."""
    try:
        return ("returned", f())
    except Exception as e:
        return (type(e), str(e))


def _scheduler(bm: BlockManager, *, budget: int = 64, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64)


def _held(sched: Scheduler) -> list[SpecSequence]:
    """The sequences holding blocks: the running ones (S1)."""
    return [*sched.running]


def _names(seqs: list[SpecRequest]) -> list[str]:
    return [s.seq_id for s in seqs]


# --------------------------------------------------------------------------------------------
# The allocator's refusals, in the words the engine's twin uses too: kills
# spec.block_manager xǁBlockManagerǁallocate__mutmut_14 (too few free blocks),
# deallocate__mutmut_3 (a double release) and check_invariants__mutmut_8 (R12's partition),
# each message padded with "XX".
# --------------------------------------------------------------------------------------------


def test_allocating_past_the_free_queue_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = SpecSequence([1, 2, 3, 4, 5], 2)  # 3 blocks, 2 free
    assert bm.can_allocate(seq) is None
    before = _state(bm, seq)
    assert _outcome(lambda: bm.allocate(seq, 0)) == (
        RuntimeError,
        "allocate: not enough free blocks for this sequence",
    )
    assert _state(bm, seq) == before


def test_a_double_release_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _allocated(bm, [1, 2, 3])
    bm.deallocate(seq)
    before = _state(bm, seq)
    assert bm.snapshot().free_queue == (2, 3, 1, 0)  # R3: last block first, to the tail
    assert _outcome(lambda: bm.deallocate(seq)) == (
        RuntimeError,
        "deallocate: the sequence holds no blocks (double release?)",
    )
    assert _state(bm, seq) == before


@pytest.mark.parametrize("corrupt", ["lost", "twice"])
def test_a_pool_the_free_queue_does_not_partition_is_reported_by_name(corrupt: str) -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    _allocated(bm, [1, 2, 3])  # blocks 0, 1 in use; 2, 3 free
    bm.check_invariants()
    if corrupt == "lost":
        bm.free_queue.remove(3)  # a free block in neither the queue nor in use
    else:
        bm.free_queue.append(2)  # a free block queued twice
    assert _outcome(bm.check_invariants) == (
        AssertionError,
        "free queue and used blocks do not partition the pool",
    )


# --------------------------------------------------------------------------------------------
# R8 after a step that computed no tokens of the sequence: nothing became full, nothing is
# registered, and nothing is refused (the engine's twin returns too; only counts outside the
# sequence are refused). Kills spec.block_manager xǁBlockManagerǁhash_blocks__mutmut_6
# (`scheduled <= 0`) and _7 (`scheduled < 1`), which refuse a count of 0.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cached", [0, 2, 3])
def test_registering_after_zero_scheduled_tokens_changes_nothing(cached: int) -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = _allocated(bm, [1, 2, 3])
    seq.num_cached_tokens, seq.num_scheduled_tokens = cached, 0
    before = _state(bm, seq)
    assert _outcome(lambda: bm.hash_blocks(seq)) == ("returned", None)
    assert _state(bm, seq) == before
    assert bm.hash_to_block == {}  # no block became full in a step that computed nothing


# --------------------------------------------------------------------------------------------
# S5 tells blocks apart as the prefix cache does, salt included (R4s): a request whose first
# missing block has the same tokens as one another request completes this step, but under
# another salt (or none), is another block and is not deferred. Kills spec.scheduler
# xǁSchedulerǁ_chain__mutmut_2 (`h = None`) and _4 (`... is None) or True`): the salt
# ignored, so every such request waits a step for a block it can never hit.
# --------------------------------------------------------------------------------------------


def test_a_request_under_another_salt_is_not_deferred_for_a_block_it_cannot_hit() -> None:
    sched = _scheduler(BlockManager(num_blocks=16, block_size=4))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    sched.add(SpecRequest(list(tokens), 4, seq_id="plain"))
    sched.add(SpecRequest(list(tokens), 4, seq_id="a", cache_salt="a"))
    sched.add(SpecRequest(list(tokens), 4, seq_id="b", cache_salt="b"))
    sched.add(SpecRequest(list(tokens), 4, seq_id="a again", cache_salt="a"))  # shares a's
    batch, is_prefill = sched.schedule()
    assert is_prefill
    assert _names(batch) == ["plain", "a", "b"]
    assert _names(sched.waiting) == ["a again"]
    assert [s.num_scheduled_tokens for s in batch] == [9, 9, 9]


# --------------------------------------------------------------------------------------------
# S5 with a continuing chunked prefill (S3): the blocks its chunk completes defer a waiting
# request that would hit them next step. Kills spec.scheduler xǁSchedulerǁ_schedule_prefill__
# mutmut_14 (S3's chunks note their blocks in None). Its only effect is an AttributeError
# (None has no append) in a valid step, which the outcome comparison reports.
# --------------------------------------------------------------------------------------------


def test_blocks_a_continuing_chunk_completes_defer_a_request_that_shares_them() -> None:
    sched = _scheduler(BlockManager(num_blocks=16, block_size=2), budget=4)
    long = SpecRequest([1, 2, 3, 4, 5, 6, 7], 2, seq_id="long")
    sched.add(long)
    batch, _ = sched.schedule()
    sched.postprocess(batch, [None])  # blocks 0 and 1 computed and registered
    sharing = SpecRequest([1, 2, 3, 4, 5, 6, 8, 9], 2, seq_id="sharing")
    sched.add(sharing)
    # long's chunk completes block 2 (5, 6), sharing's first miss: sharing waits a step.
    outcome = _outcome(lambda: [(s.seq_id, s.num_scheduled_tokens) for s in sched.schedule()[0]])
    assert outcome == ("returned", [("long", 3)])
    assert _names(sched.waiting) == ["sharing"]


# --------------------------------------------------------------------------------------------
# S5 compares the first missing block only with the blocks this step completes, not with
# blocks a continuing prefill computed in an earlier step. Under a hash where every block
# collides, the hash map holds one entry (the last registered block, R8 overwrites), so a
# block in use can be unreachable (R10 rejects the entry's other tokens): the request that
# misses it must not wait for it. Kills spec.scheduler xǁSchedulerǁ_chunk__mutmut_13 (every
# block below the chunk's end noted as completed, from block 0). This also shows that
# tests/equivalent_mutants.md's argument for that mutant ("a block in use ... a later
# request whose chain reaches one hits it") does not hold once the map entry is overwritten.
# --------------------------------------------------------------------------------------------


def _one_hash(token_ids: tuple[int, ...], prefix: int | None) -> int:
    """Every block collides: R10's token check decides each lookup."""
    return 7


def test_a_block_computed_in_an_earlier_step_is_not_waited_for() -> None:
    bm = BlockManager(num_blocks=16, block_size=2, hash_fn=_one_hash)
    sched = _scheduler(bm, budget=4)
    long = SpecRequest([1, 2, 3, 4, 5, 6, 7], 2, seq_id="long")
    sched.add(long)
    batch, _ = sched.schedule()
    assert _names(batch) == ["long"] and long.num_scheduled_tokens == 4
    sched.postprocess(batch, [None])  # blocks 0 (1, 2) and 1 (3, 4) registered
    assert bm.hash_to_block == {7: long.block_table[1]}  # block 0's entry overwritten
    late = SpecRequest([1, 2, 8, 9, 10], 2, seq_id="late")
    sched.add(late)
    batch, is_prefill = sched.schedule()
    # long continues with block 2 (5, 6) and token 7; late's first miss is block 0 (1, 2),
    # which long computed a step ago: not completed now, so late is admitted with the
    # budget's last token.
    assert is_prefill
    assert _names(batch) == ["long", "late"]
    assert [s.num_scheduled_tokens for s in batch] == [3, 1]
    assert sched.waiting == []


# --------------------------------------------------------------------------------------------
# S4/S5: each waiting request is considered at most once per step, a deferred one keeping
# its place while the later ones are considered. Kills spec.scheduler xǁSchedulerǁ
# _schedule_prefill__mutmut_38 (`i = 1` on a deferral): a second deferral in a step sends
# the loop back to index 1 for good; the allocator below fails a check at the second
# question about the same request instead of the test hanging.
# --------------------------------------------------------------------------------------------


class _AskedOnce(BlockManager):
    """The reference allocator, checking that a step asks ``can_allocate`` about each
    sequence at most once (``asked`` is cleared by the test between steps)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.asked: list[SpecSequence] = []

    def can_allocate(self, seq: SpecSequence) -> int | None:
        assert all(s is not seq for s in self.asked), "a waiting request considered twice"
        self.asked.append(seq)
        return super().can_allocate(seq)


def test_two_deferred_requests_are_each_considered_once() -> None:
    bm = _AskedOnce(num_blocks=16, block_size=4)
    sched = _scheduler(bm)
    first = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, seq_id="first")
    one = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 10], 4, seq_id="one")  # both deferred:
    two = SpecRequest([1, 2, 3, 4, 5, 6, 7, 8, 11], 4, seq_id="two")  # first completes 0, 1
    for seq in (first, one, two):
        sched.add(seq)
    batch, _ = sched.schedule()
    assert _names(batch) == ["first"]
    assert _names(sched.waiting) == ["one", "two"]
    assert bm.asked == [first, one, two]
    sched.postprocess(batch, [3])
    bm.asked.clear()
    batch, _ = sched.schedule()  # now both hit first's two blocks (R5)
    assert _names(batch) == ["one", "two"]
    assert [s.num_cached_tokens for s in batch] == [8, 8]


# --------------------------------------------------------------------------------------------
# is_finished: True only when neither queue holds work. Kills spec.scheduler xǁSchedulerǁ
# is_finished__mutmut_1 (`or`: finished as soon as one queue is empty).
# --------------------------------------------------------------------------------------------


def test_is_finished_only_when_nothing_waits_and_nothing_runs() -> None:
    sched = _scheduler(BlockManager(num_blocks=8, block_size=4))
    assert sched.is_finished()
    seq = SpecRequest([1, 2, 3], 4, seq_id="s", max_tokens=2)
    sched.add(seq)
    assert not sched.is_finished()  # waiting, nothing running
    batch, _ = sched.schedule()
    assert not sched.is_finished()  # running, nothing waiting
    sched.postprocess(batch, [5])
    batch, _ = sched.schedule()
    sched.postprocess(batch, [6])  # max_tokens=2 reached
    assert seq.status == "finished"
    assert sched.is_finished()


# --------------------------------------------------------------------------------------------
# postprocess pairs each scheduled sequence with one result: another number of results is
# refused (ValueError), and recover() then sends back whatever had not been processed (S11).
# Kills spec.scheduler xǁSchedulerǁpostprocess__mutmut_4 (`strict=None`), _7 (no strict)
# and _8 (`strict=False`), which drop the unmatched tail silently.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("results", [[7], [7, 7, 7]], ids=["short", "long"])
def test_results_of_another_length_than_the_batch_are_refused(results: list[int]) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = _scheduler(bm)
    a = SpecRequest([1, 2, 3], 4, seq_id="a")
    b = SpecRequest([4, 5, 6], 4, seq_id="b")
    sched.add(a)
    sched.add(b)
    batch, _ = sched.schedule()
    assert _names(batch) == ["a", "b"]
    outcome = _outcome(lambda: sched.postprocess(batch, list(results)))
    assert outcome[0] is ValueError
    unprocessed = [] if len(results) > 2 else ["b"]
    assert _names(sched.recover()) == unprocessed
    bm.check_invariants(_held(sched))


# --------------------------------------------------------------------------------------------
# S11: recover forgets the error of a failed sample whose bookkeeping raised before it
# committed (the step is redone; the sequence has not failed). Kills spec.scheduler
# xǁSchedulerǁrecover__mutmut_22 (`errors.pop(None, None)`): the error stays, and the
# retried sequence would finish with "error" whatever it samples.
# --------------------------------------------------------------------------------------------


class _FailingRelease(BlockManager):
    """The reference allocator whose next ``deallocate`` raises before it changes
    anything, once ``armed``."""

    armed = False

    def deallocate(self, seq: SpecSequence) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected fault in deallocate")
        super().deallocate(seq)


def test_recover_forgets_the_error_of_a_failed_sample_it_sends_back() -> None:
    bm = _FailingRelease(num_blocks=8, block_size=4)
    sched = _scheduler(bm)
    seq = SpecRequest([1, 2, 3], 4, seq_id="s", max_tokens=1)
    sched.add(seq)
    batch, _ = sched.schedule()
    bm.armed = True  # the failed sample finishes it, and its release raises
    outcome = _outcome(lambda: sched.postprocess(batch, [SpecFailedSample("nan")]))
    assert outcome == (RuntimeError, "injected fault in deallocate")
    assert _names(sched.recover()) == ["s"]
    assert sched.errors == {}
    assert _names(sched.waiting) == ["s"] and seq.status == "waiting"
    batch, _ = sched.schedule()  # the retried step samples a token this time
    assert _names(sched.postprocess(batch, [5])) == ["s"]
    assert sched.finish_reason(seq) == "length"
    assert sched.stop_reason(seq) is None


# --------------------------------------------------------------------------------------------
# A stall (work remains, nothing fits) is a RuntimeError that says "scheduler stalled: ",
# the words both twins use (the engine's adds the queue lengths), and changes nothing.
# Kills spec.scheduler xǁSchedulerǁschedule__mutmut_10 (message None), _11 ("XX...XX") and
# _12 (upper case).
# --------------------------------------------------------------------------------------------


def test_a_stall_is_refused_by_name_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    sched = _scheduler(bm)
    seq = SpecRequest([1, 2, 3, 4, 5], 2, seq_id="big")  # 3 blocks, the pool has 2
    sched.add(seq)
    before = bm.snapshot()
    kind, message = _outcome(sched.schedule)
    assert kind is RuntimeError
    assert message.startswith("scheduler stalled: ")
    assert _names(sched.waiting) == ["big"] and sched.running == []
    assert bm.snapshot() == before and seq.block_table == []
    assert sched.stats.steps == 0 and sched.stats.failed_steps == 0
