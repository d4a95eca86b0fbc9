"""Tests that kill mutants mutmut (tox -e mutation) found alive in the scheduler.

Each section names what it kills, by the ids of the mutmut run that found them, when the
scheduler was one file, engine/scheduler.py: ``allocator_chain`` and ``__init__`` are now
in engine/scheduler_state.py, ``_schedule_decode`` in engine/preemption.py. Expected
values come from docs/design.md's rules written out by hand (R4's hash chain straight
from xxhash), never from the scheduler.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import xxhash

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.scheduler_state import allocator_chain
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.sampling_params import SamplingParams
from spec.block_manager import BlockManager as SpecBlockManager


def _r4(tokens: tuple[int, ...], prefix: int | None) -> int:
    """R4 by hand: xxh64 over the previous hash (8 bytes, little-endian) and the tokens
    as little-endian int64s; an unsigned digest."""
    head = b"" if prefix is None else prefix.to_bytes(8, "little")
    return xxhash.xxh64(head + struct.pack(f"<{len(tokens)}q", *tokens)).intdigest()


def _outcome(f: Callable[..., Any], *args: Any) -> Any:
    """What a call returns, or the type and message of what it raised: a wrong answer
    either way, compared by the assertion."""
    try:
        return f(*args)
    except Exception as e:
        return (type(e), str(e))


# --------------------------------------------------------------------------------------------
# allocator_chain over an allocator with a hash_fn (the spec's, as the lockstep tests use it):
# kills x_allocator_chain__mutmut_13, 15, 17-21 (the salt dropped or hashed wrongly) and 24
# (every hash None). The selection's salted sequences all ran against the engine allocator.
# --------------------------------------------------------------------------------------------


def test_the_chain_of_a_spec_allocator_is_r4_with_the_salt_block_as_prefix() -> None:
    seq = Sequence(list(range(1, 11)), block_size=4, cache_salt="tenant-a")
    hashes, tokens = allocator_chain(SpecBlockManager(num_blocks=8, block_size=4))
    # R4s: block 0's prefix is the hash of the block (-1, *utf8(salt)) with no prefix.
    salt = _r4((-1, *b"tenant-a"), None)
    h0 = _r4((1, 2, 3, 4), salt)
    h1 = _r4((5, 6, 7, 8), h0)
    assert _outcome(hashes, seq, 2) == [h0, h1]
    assert _outcome(tokens, seq, 2) == [(1, 2, 3, 4), (5, 6, 7, 8)]
    plain = Sequence(list(range(1, 11)), block_size=4)
    assert _outcome(hashes, plain, 2) == [
        _r4((1, 2, 3, 4), None),
        _r4((5, 6, 7, 8), _r4((1, 2, 3, 4), None)),
    ]


# --------------------------------------------------------------------------------------------
# An allocator without a hash chain: kills x_allocator_chain__mutmut_6 (getattr without its
# default: AttributeError), 10 (no message), 12 (the message names NoneType).
# --------------------------------------------------------------------------------------------


class NoChain:
    """An allocator with no hash chain at all (neither a BlockHasher nor a hash_fn)."""

    num_free_blocks = 4


def test_prefix_aware_admission_refuses_an_allocator_without_a_chain_by_name() -> None:
    got = _outcome(allocator_chain, NoChain())
    assert got == (
        TypeError,
        "prefix-aware admission needs the allocator's hash chain: NoChain has no hash_fn "
        "(pass prefix_aware=False)",
    )
    # Without prefix-aware admission the chain is never asked for.
    sched = Scheduler(
        NoChain(),  # type: ignore[arg-type]
        num_blocks=4,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=16,
        prefix_aware=False,
    )
    assert sched._hash_chain is None


# --------------------------------------------------------------------------------------------
# recover() after a step that failed a sample and then raised releasing the sequence: kills
# xǁSchedulerǁrecover__mutmut_26 (the failed sample's reason kept in ``errors``, so the rerun
# request would still finish with "error").
# --------------------------------------------------------------------------------------------


class FailsOnce(BlockManager):
    """The engine's allocator, whose first ``deallocate`` raises before changing anything."""

    failed = False

    def deallocate(self, seq: Sequence) -> None:
        if not self.failed:
            self.failed = True
            raise MemoryError("injected")
        super().deallocate(seq)


def test_recover_forgets_the_reason_of_a_sample_it_undoes() -> None:
    bm = FailsOnce(num_blocks=8, block_size=4)
    sched = Scheduler(bm, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=1), block_size=4)
    sched.add(seq)
    batch, is_prefill = sched.schedule()
    assert batch == [seq] and is_prefill
    try:
        sched.postprocess(batch, [FailedSample("logits are not finite")])
    except MemoryError:
        pass
    else:
        raise AssertionError("the injected fault did not fire")
    assert sched.recover() == [seq]
    assert seq.status is SequenceStatus.WAITING
    assert sched.errors == {}
    # Rerun, it samples a token: its finish reason is its own, not the undone failure's.
    batch, _ = sched.schedule()
    assert batch == [seq]
    sched.postprocess(batch, [7])
    assert seq.status is SequenceStatus.FINISHED
    assert sched.finish_reason(seq) == "length"


# --------------------------------------------------------------------------------------------
# Prefix-aware admission is the default: kills xǁSchedulerǁ__init____mutmut_1 (default
# False) and 3 (the public ``prefix_aware`` attribute set to None). The selection's
# schedulers all passed prefix_aware explicitly.
# --------------------------------------------------------------------------------------------


def _two_sharing_a_prefix(**kwargs: Any) -> tuple[Scheduler, Sequence, Sequence]:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(
        bm, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, **kwargs
    )
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    second = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 10], block_size=4)
    sched.add(first)
    sched.add(second)
    return sched, first, second


def test_by_default_a_request_waits_for_the_blocks_an_earlier_one_computes() -> None:
    sched, first, second = _two_sharing_a_prefix()
    assert sched.prefix_aware is True
    # The first computes blocks 0 and 1 in this step; the second would compute the same
    # two again, so it is deferred (S5, engine/admission.py) ...
    assert sched.schedule() == ([first], True)
    assert list(sched.waiting) == [second]
    # ... and without prefix awareness both run at once.
    sched, first, second = _two_sharing_a_prefix(prefix_aware=False)
    assert sched.prefix_aware is False
    assert sched.schedule() == ([first, second], True)


# --------------------------------------------------------------------------------------------
# schedule()'s refusals name the problem and change nothing: kills
# xǁSchedulerǁschedule__mutmut_1, 2, 3 (the in-flight guard's message) and 10 (the stall's).
# --------------------------------------------------------------------------------------------


def _scheduler(num_blocks: int, block_size: int, **kwargs: Any) -> Scheduler:
    bm = kwargs.pop("bm", None) or BlockManager(num_blocks=num_blocks, block_size=block_size)
    limits = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64}
    return Scheduler(bm, num_blocks=num_blocks, **(limits | kwargs))


def test_a_second_schedule_before_postprocess_is_refused_by_name() -> None:
    sched = _scheduler(8, 4)
    seq = Sequence([1, 2, 3], block_size=4)
    sched.add(seq)
    batch, _ = sched.schedule()
    before = (list(sched.running), list(sched.waiting), seq.num_scheduled_tokens, seq.block_table)
    assert _outcome(sched.schedule) == (
        RuntimeError,
        "schedule: the previous step was neither post-processed nor recovered",
    )
    assert (
        list(sched.running),
        list(sched.waiting),
        seq.num_scheduled_tokens,
        seq.block_table,
    ) == (before)
    sched.postprocess(batch, [5])  # the step it refused to replace goes on
    assert seq.token_ids == [1, 2, 3, 5]


def test_a_stalled_scheduler_says_what_is_queued_and_free() -> None:
    sched = _scheduler(4, 4)
    too_big = Sequence(list(range(1, 21)), block_size=4)  # 5 blocks, past validation
    sched.add(too_big)
    assert _outcome(sched.schedule) == (
        RuntimeError,
        "scheduler stalled: 1 waiting, 0 running, 4 free blocks",
    )
    assert list(sched.waiting) == [too_big] and sched.block_manager.num_free_blocks == 4
    assert too_big.status is SequenceStatus.WAITING and too_big.block_table == []


# --------------------------------------------------------------------------------------------
# A preemption that raises: kills xǁSchedulerǁ_schedule_decode__mutmut_19 (the victim's token
# count recorded as None, so recover() would cut its tokens instead of keeping them).
# --------------------------------------------------------------------------------------------


class FailsWhenArmed(BlockManager):
    """The engine's allocator, whose next ``deallocate`` raises (before changing anything)
    once ``armed`` is set."""

    armed = False

    def deallocate(self, seq: Sequence) -> None:
        if self.armed:
            self.armed = False
            raise MemoryError("injected")
        super().deallocate(seq)


def test_a_preemption_that_raises_leaves_both_sequences_whole() -> None:
    bm = FailsWhenArmed(num_blocks=4, block_size=1)
    sched = _scheduler(4, 1, bm=bm)
    a, b = Sequence([1], block_size=1), Sequence([2], block_size=1)
    sched.add(a)
    sched.add(b)
    for _ in range(2):  # a prefill, then a decode: every token takes a block, 4 in all
        batch, _ = sched.schedule()
        assert batch == [a, b]
        sched.postprocess(batch, [7, 7])
    assert bm.num_free_blocks == 0
    bm.armed = True  # a needs a block: b, the newest, is preempted, and that raises
    assert _outcome(sched.schedule) == (MemoryError, "injected")
    assert (a.token_ids, b.token_ids) == ([1, 7, 7], [2, 7, 7])
    assert list(sched.waiting) == [a, b] and list(sched.running) == []
    assert bm.num_free_blocks == 4


# --------------------------------------------------------------------------------------------
# A model runner that returns too few tokens: kills xǁSchedulerǁpostprocess__mutmut_5 (zip
# not strict, so the last sequence would silently stay in flight, unsampled).
# --------------------------------------------------------------------------------------------


def test_too_few_tokens_for_the_batch_raise_and_recover_undoes_the_rest() -> None:
    sched = _scheduler(8, 4)
    a, b = Sequence([1, 2], block_size=4), Sequence([3, 4], block_size=4)
    sched.add(a)
    sched.add(b)
    batch, _ = sched.schedule()
    assert batch == [a, b]
    got = _outcome(sched.postprocess, batch, [5])
    assert got == (ValueError, "zip() argument 2 is shorter than argument 1")
    assert a.token_ids == [1, 2, 5]  # committed before the shortfall showed
    assert sched.recover() == [b]
    assert b.token_ids == [3, 4] and list(sched.waiting) == [b]


# --------------------------------------------------------------------------------------------
# Tokens that are ints of a subclass, and bools: kills xǁSchedulerǁpostprocess__mutmut_30, 31
# (the subclass test inverted or widened), 32-39 (its token appended or checked wrongly) and
# 40 (the refusal's message). The selection's runners only returned plain ints.
# --------------------------------------------------------------------------------------------


class TokenId(int):
    """An int subclass, as a runner that returns numpy-derived or enum ids would."""


def _one_prefilled(stop: tuple[int, ...] = ()) -> tuple[Scheduler, Sequence, list[Sequence]]:
    sched = _scheduler(8, 4)
    seq = Sequence([1, 2, 3], SamplingParams(stop_token_ids=stop, max_tokens=4), block_size=4)
    sched.add(seq)
    batch, is_prefill = sched.schedule()
    assert batch == [seq] and is_prefill
    return sched, seq, batch


def test_an_int_subclass_token_is_appended_as_a_plain_int_and_can_stop() -> None:
    sched, seq, batch = _one_prefilled(stop=(9,))
    assert _outcome(sched.postprocess, batch, [TokenId(9)]) == [seq]
    assert seq.token_ids == [1, 2, 3, 9] and type(seq.token_ids[-1]) is int
    assert seq.status is SequenceStatus.FINISHED
    assert sched.finish_reason(seq) == "stop"
    sched, seq, batch = _one_prefilled(stop=(9,))
    assert _outcome(sched.postprocess, batch, [TokenId(8)]) == []
    assert seq.token_ids == [1, 2, 3, 8] and seq.status is SequenceStatus.RUNNING


def test_a_bool_or_none_token_is_refused_by_name_and_recover_undoes_the_step() -> None:
    for bad in (True, None):
        sched, seq, batch = _one_prefilled()
        got = _outcome(sched.postprocess, batch, [bad])
        assert got == (
            RuntimeError,
            f"the model runner returned {bad!r} for {seq}, which samples in this step",
        )
        assert seq.token_ids == [1, 2, 3]  # nothing appended
        assert sched.recover() == [seq]
        assert list(sched.waiting) == [seq] and seq.block_table == []


# --------------------------------------------------------------------------------------------
# The deferral keys a block by its hash and its tokens (S5 with R10): kills
# admission.xǁPrefillAdmissionǁ_block_keys__mutmut_10 (the tokens dropped from the key, so a
# request whose next block only collides in hash with one this step computes is deferred).
# --------------------------------------------------------------------------------------------


def test_a_block_that_only_collides_in_hash_does_not_defer_a_request() -> None:
    def one_hash(token_ids: Any, prefix: int | None) -> int:
        return 7  # every block collides: R10's tokens tell them apart

    bm = BlockManager(num_blocks=16, block_size=4, hash_fn=one_hash)
    sched = _scheduler(16, 4, bm=bm)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    other = Sequence([11, 12, 13, 14, 15, 16, 17, 18, 19], block_size=4)  # same hashes
    same = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 10], block_size=4)  # same blocks as first
    for seq in (first, other, same):
        sched.add(seq)
    # first computes blocks [1..4], [5..8] (keys (7, those tokens)); other's blocks share
    # the hash but not the tokens, so it runs now; same's are first's, so it waits (S5).
    assert sched.schedule() == ([first, other], True)
    assert list(sched.waiting) == [same]


# --------------------------------------------------------------------------------------------
# Steps are all-prefill or all-decode unless mixed_steps is asked for (S2; S2m is opt-in):
# kills scheduler_state.xǁSchedulerStateǁ__init____mutmut_2 (mixed_steps on by default).
# --------------------------------------------------------------------------------------------


def test_by_default_a_waiting_prefill_runs_alone_while_a_sequence_decodes() -> None:
    sched = _scheduler(16, 4)
    decoding = Sequence([1, 2, 3, 4, 5], block_size=4)
    sched.add(decoding)
    assert sched.schedule() == ([decoding], True)
    sched.postprocess([decoding], [6])
    late = Sequence([9, 9, 9, 9, 9, 9], block_size=4)
    sched.add(late)
    assert sched.schedule() == ([late], True)  # mixed steps would take [decoding, late]
