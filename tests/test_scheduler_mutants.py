"""Every scheduler mutant (tests/scheduler_mutants.py) fails a machine's own check.

Caught means an AssertionError from a comparison or an invariant: a mutant that merely
crashes (IndexError, a stall's RuntimeError) or hangs is not caught. The scheduler
machine compares the engine's scheduler with the spec's, so it sees policy and
statistics; the engine machine compares whole engines with the model run alone, so it
sees what reaches the outputs. The real code passes both hunts at the same budget
(``HUNT``), and the engine mutants fail the engine tests that pin their behaviour.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests import engine_machine, scheduler_machine
from tests import scheduler_mutants as m
from tests.test_engine import (
    check_abort_forgets_the_request,
    check_liveness_with_the_smallest_legal_pool,
    check_run_stats_are_per_call,
)

HUNT = settings(
    max_examples=300,  # every mutant below falls within 150 on the scheduler machine
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)
SCHEDULER_MUTANTS = m.SUBCLASS_MUTANTS + m.HELD_OUT_MUTANTS + m.RULE_MUTANTS


@pytest.mark.parametrize("mutant", SCHEDULER_MUTANTS, ids=[c.__name__ for c in SCHEDULER_MUTANTS])
def test_the_scheduler_machine_catches(mutant: type) -> None:
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(scheduler_machine.make_machine(mutant), settings=HUNT)
    # The machine reports an engine that raised as a difference; that is a crash, not a
    # catch by the comparison.
    assert caught.value.__cause__ is None or not str(caught.value).startswith("the engine's "), (
        f"{mutant.__name__} was caught only by crashing: {caught.value.__cause__!r}"
    )


@pytest.mark.parametrize("mutant", m.SUBCLASS_MUTANTS, ids=[c.__name__ for c in m.SUBCLASS_MUTANTS])
def test_the_engine_machine_catches(mutant: type) -> None:
    with pytest.raises(AssertionError):
        run_state_machine_as_test(engine_machine.make_machine(mutant), settings=HUNT)


def test_the_engine_machine_catches_an_abort_that_keeps_the_request() -> None:
    machine = engine_machine.make_machine(engine_cls=m.AbortKeepsRequest)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=HUNT)


@pytest.mark.parametrize("make", [scheduler_machine.make_machine, engine_machine.make_machine])
def test_the_real_code_passes_the_same_hunts(make: Callable[[], type]) -> None:
    run_state_machine_as_test(make(), settings=HUNT)


def test_an_abort_that_keeps_the_request_fails_the_abort_test() -> None:
    check_abort_forgets_the_request()  # passes on the real engine
    with pytest.raises(AssertionError):
        check_abort_forgets_the_request(m.AbortKeepsRequest)


def test_run_stats_not_taken_over_the_call_fail_the_run_stats_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_run_stats_are_per_call()  # passes on the real engine
    monkeypatch.setattr(m.llm_engine_module, "run_stats", m.prefill_tokens_not_a_difference)
    with pytest.raises(AssertionError):
        check_run_stats_are_per_call()


def test_a_prefill_chunk_sized_from_the_prompt_fails_the_liveness_test() -> None:
    """It recomputes none of a preempted sequence's generated tokens, so the sequence
    never finishes its prefill: before the step guard, the liveness test hung."""
    with pytest.raises(AssertionError):
        check_liveness_with_the_smallest_legal_pool(m.ChunkFromPrompt)
