"""The scheduler spec against the engine's scheduler: the lockstep machine (see
tests/scheduler_machine.py) over the real scheduler, exact examples of the deferral rule
(S5) run on both, with the defect it replaced shown by its mutant, and the machine's
in-step allocator check (``CheckedBlockManager``) shown to fire."""

from __future__ import annotations

from typing import Any

import pytest

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from spec.block_manager import BlockManager as SpecBlockManager
from spec.scheduler import Scheduler as SpecScheduler
from spec.scheduler import SpecRequest
from tests.lockstep import CheckedBlockManager, ContractBreach
from tests.scheduler_machine import make_machine
from tests.scheduler_subclass_mutants import DeferByPosition

TestSchedulerMachine = make_machine().TestCase

Batches = list[list[tuple[str, int]]]


def drive(
    side: str,
    pool: int,
    arrivals: list[list[tuple[str, list[int], str | None]]],
    scheduler_cls: type[Scheduler] = Scheduler,
) -> tuple[Batches, dict[str, int | None]]:
    """Block size 4, ample budget; each wave of (name, prompt, salt) arrives when the
    last has drained; every request samples one token (7) and finishes. Returns every
    step's batch and each request's first-admission prefix hits."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    sched: Any
    if side == "spec":
        sched = SpecScheduler(SpecBlockManager(pool, 4), **limits)  # type: ignore[arg-type]
    else:
        sched = scheduler_cls(BlockManager(pool, 4), num_blocks=pool, **limits)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    names: dict[int, str] = {}
    seqs = []
    batches: Batches = []
    for wave in arrivals:
        for name, prompt, salt in wave:
            seq: Any
            if side == "spec":
                seq = SpecRequest(
                    list(prompt), 4, seq_id=name, max_tokens=1, ignore_eos=True, cache_salt=salt
                )
            else:
                seq = Sequence(prompt, params, block_size=4, cache_salt=salt)
            names[id(seq)] = name
            seqs.append(seq)
            sched.add(seq)
        for _ in range(10):  # a step guard: each wave drains in a few steps
            if sched.is_finished():
                break
            batch, is_prefill = sched.schedule()
            assert is_prefill
            batches.append([(names[id(s)], s.num_scheduled_tokens) for s in batch])
            sched.postprocess(batch, [7] * len(batch))
        assert sched.is_finished(), "a wave did not drain in 10 steps"
    return batches, {names[id(s)]: s.num_prefix_hit_tokens for s in seqs}


CACHE_3333 = [("C", [3, 3, 3, 3, 5], None)]
"""Leaves block (3, 3, 3, 3) registered, in the free queue."""
A = ("A", [1, 1, 1, 1, 2, 2, 2, 2, 0], None)
B = ("B", [3, 3, 3, 3, 2, 2, 2, 2, 4], None)
"""A and B: different first blocks, equal second blocks: neither can hit the other's."""
D = ("D", [0, 0, 0, 0, 0, 0, 0, 0, 0], None)

DEFERRAL_CASES = {
    # The reproduction: B deferred a step for nothing.
    "lost-step": (
        16,
        [CACHE_3333, [A, B]],
        [[("C", 5)], [("A", 9), ("B", 5)]],
        [[("C", 5)], [("A", 9)], [("B", 5)]],
    ),
    # In a pool of 6, D is admitted in B's place and its fresh blocks evict (3, 3, 3, 3):
    # B then loses its prefix hit as well.
    "lost-hit": (
        6,
        [CACHE_3333, [A, B, D]],
        [[("C", 5)], [("A", 9), ("B", 5)], [("D", 9)]],
        [[("C", 5)], [("A", 9), ("D", 9)], [("B", 9)]],
    ),
    # Same tokens under another cache salt: another chain (R4s), so nothing to wait for.
    "salted": (
        16,
        [[("S", [1, 1, 1, 1, 2, 2, 2, 2, 0], None), ("T", [1, 1, 1, 1, 2, 2, 2, 2, 0], "t")]],
        [[("S", 9), ("T", 9)]],
        [[("S", 9)], [("T", 9)]],
    ),
}


@pytest.mark.parametrize("side", ["spec", "engine"])
@pytest.mark.parametrize("case", DEFERRAL_CASES, ids=list(DEFERRAL_CASES))
def test_deferral_is_keyed_by_the_chain(side: str, case: str) -> None:
    """S5: a request waits only for a block it will hit: same chain, same tokens."""
    pool, arrivals, right, _ = DEFERRAL_CASES[case]
    batches, hits = drive(side, pool, arrivals)
    assert batches == right
    if case == "lost-hit":
        assert hits == {"C": 0, "A": 0, "B": 4, "D": 0}


@pytest.mark.parametrize("case", DEFERRAL_CASES, ids=list(DEFERRAL_CASES))
def test_deferral_by_position_and_tokens_is_the_defect(case: str) -> None:
    """The key this replaced, (position, tokens), gives exactly the wrong batches above."""
    pool, arrivals, _, wrong = DEFERRAL_CASES[case]
    batches, hits = drive("engine", pool, arrivals, DeferByPosition)
    assert batches == wrong
    if case == "lost-hit":
        assert hits["B"] == 0


def test_a_true_deferral_still_waits_for_the_hit() -> None:
    """S5's purpose: B shares A's first two blocks (same chain), so it waits a step and
    hits both instead of computing them again; on both sides."""
    a = ("A", [1, 1, 1, 1, 2, 2, 2, 2, 0], None)
    b = ("B", [1, 1, 1, 1, 2, 2, 2, 2, 4], None)
    for side in ("spec", "engine"):
        batches, hits = drive(side, 16, [[a, b]])
        assert batches == [[("A", 9)], [("B", 1)]], side
        assert hits == {"A": 0, "B": 8}, side


def test_the_checked_allocator_names_a_table_changed_behind_its_back() -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    live: list[Sequence] = []
    bm = CheckedBlockManager(8, 2, live=lambda: live)
    a, b = Sequence([1, 2, 3], params, block_size=2), Sequence([4, 5, 6], params, block_size=2)
    live += [a, b]
    bm.allocate(a, bm.can_allocate(a) or 0)  # the control: calls within the contract pass
    a.block_table.clear()  # what a preemption that skips deallocate leaves (ref counts kept)
    with pytest.raises(ContractBreach, match=r"before can_allocate.*table holders"):
        bm.can_allocate(b)


def test_the_checked_allocator_refuses_growth_of_a_sequence_not_decoding() -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    seq = Sequence([1, 2, 3], params, block_size=2)
    bm = CheckedBlockManager(8, 2, live=lambda: [seq])
    bm.allocate(seq, 0)  # nothing computed yet: a prefill
    for call in (bm.can_append, bm.may_append):
        with pytest.raises(ContractBreach, match=r"not decoding \(0 of 3 tokens computed\)"):
            call(seq)
    seq.num_scheduled_tokens = 3
    bm.hash_blocks(seq)
    seq.num_cached_tokens = 3
    seq.append_token(7)  # decoding now: all but the newest token computed
    assert bm.can_append(seq) is True
    bm.may_append(seq)
    assert len(seq.block_table) == 2
