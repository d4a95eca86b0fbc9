"""The invariant that makes three spec-scheduler survivors of mutmut (tox -e mutation)
equivalent (tests/equivalent_mutants.md, "spec/scheduler.py"), checked over random traffic.
"""

from __future__ import annotations

import random
from typing import Any

from spec.block_manager import BlockManager
from spec.records import SpecFailedSample
from spec.scheduler import Scheduler, SpecRequest

# --------------------------------------------------------------------------------------------
# Kills nothing: it checks the invariant that makes three survivors equivalent
# (spec.scheduler xǁSchedulerǁ_schedule_prefill__mutmut_6 `len(batch) <= max_num_seqs` and _7
# `budget >= 0` in S3's loop, postprocess__mutmut_18 `break` after a partial chunk): at the
# start of a step at most one running sequence is mid-prompt, and in a prefill batch only the
# last sequence can be left mid-prompt (a chunk is cut short only by the budget, which then
# admits nothing more). Random traffic: prefix hits, deferrals, salts, preemptions, failed
# samples, aborts, and steps whose postprocess raises.
# --------------------------------------------------------------------------------------------


def _drive(seed: int) -> int:
    """Runs random traffic through a spec scheduler, checking the invariant at every step;
    returns the number of steps that left a sequence mid-prompt."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(num_blocks=rng.randint(4, 12), block_size=bs)
    sched = Scheduler(
        bm,
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=rng.randint(1, 12),
        max_model_len=bm.num_blocks * bs,  # any one sequence fits the pool: no stall
        eos_token_ids=(0,),
    )
    cut_short = 0
    for i in range(60):
        if rng.random() < 0.4:
            n = rng.randint(1, bm.num_blocks * bs - 1)
            sched.add(
                SpecRequest(
                    [rng.randrange(3) for _ in range(n)],
                    bs,
                    seq_id=str(i),
                    max_tokens=rng.randint(1, 4),
                    cache_salt=rng.choice([None, None, "a"]),
                )
            )
        if rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running))
        if sched.is_finished():
            continue
        assert sum(s.is_prefill for s in sched.running) <= 1
        batch, is_prefill = sched.schedule()
        left = [s for s in batch if s.num_cached_tokens + s.num_scheduled_tokens < len(s)]
        assert is_prefill or not left
        assert left in ([], [batch[-1]])
        cut_short += bool(left)
        results: list[Any] = []
        for s in batch:
            if s in left:
                results.append(None)
            else:
                r = rng.random()
                results.append(
                    "?" if r < 0.05 else SpecFailedSample("x") if r < 0.1 else rng.randrange(5)
                )
        try:
            sched.postprocess(batch, results)
        except RuntimeError:
            sched.recover()
        sched.finished.clear()
        bm.check_invariants([*sched.running])  # S1: the running hold blocks
    return cut_short


def test_only_the_last_sequence_of_a_prefill_step_is_left_mid_prompt() -> None:
    assert sum(_drive(seed) for seed in range(40)) > 40  # the case arises, often
