"""The engine machine must fail on every scheduler mutant (proof it can fail)."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests import scheduler_mutants as m
from tests.engine_machine import make_machine

MUTANTS = [
    m.PreemptWithoutRelease,
    m.NoHashAfterChunk,
    m.AdmitPastTokenBudget,
    m.MaxTokensOffByOne,
    m.DecodeWithoutGrowth,
]
HUNT = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[c.__name__ for c in MUTANTS])
def test_engine_machine_catches(mutant: type) -> None:
    with pytest.raises((AssertionError, LookupError, RuntimeError)):
        run_state_machine_as_test(make_machine(mutant), settings=HUNT)


# Caught by a check (an AssertionError from the machine's invariants), not by a crash.
CHECK_CAUGHT = [m.RecoverKeepsDecodeGrowth]


@pytest.mark.parametrize("mutant", CHECK_CAUGHT, ids=[c.__name__ for c in CHECK_CAUGHT])
def test_engine_machine_checks_catch(mutant: type) -> None:
    with pytest.raises(AssertionError):
        run_state_machine_as_test(make_machine(mutant), settings=HUNT)


def test_the_real_scheduler_passes_the_same_hunt() -> None:
    run_state_machine_as_test(make_machine(), settings=settings(HUNT, max_examples=200))
