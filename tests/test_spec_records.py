"""The spec's records (spec/records.py) against the engine's: the same fields, by name.

The lockstep compares the spec's statistics and snapshots with the engine's field by field
(``tests.lockstep.assert_same_record``) after every step. These tests pin the pairing
itself, one case per field and direction, so a field the engine grows (or drops) without
the spec fails here by name; they show that the comparison fails, naming the field, on an
engine that miscounts one statistic or whose statistics record is itself wrong, a defect
that was invisible while the spec borrowed the engine's ``SchedulerStats``; and they check
the translation of the engine's ``FailedSample`` at the boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis.stateful import run_state_machine_as_test

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.outputs import FailedSample, SampleOutput
from paged_engine.engine.scheduler import Scheduler, SchedulerStats
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.records import SpecAllocatorState, SpecFailedSample, SpecSchedulerStats
from spec.scheduler import Scheduler as SpecScheduler
from spec.scheduler import SpecRequest
from tests.lockstep import assert_same_record, spec_result
from tests.scheduler_machine import make_machine
from tests.test_scheduler_mutants import HUNT

PAIRS: list[tuple[type, type]] = [
    (SpecSchedulerStats, SchedulerStats),
    (SpecAllocatorState, AllocatorState),
    (SpecFailedSample, FailedSample),
]
"""(the spec's record, the engine's record it is compared with)."""


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


FIELD_CASES = [
    pytest.param(mine, theirs, name, id=f"{theirs.__name__}.{name}-in-{mine.__name__}")
    for mine, theirs in PAIRS
    for name in _names(theirs)
] + [
    pytest.param(theirs, mine, name, id=f"{mine.__name__}.{name}-in-{theirs.__name__}")
    for mine, theirs in PAIRS
    for name in _names(mine)
]


@pytest.mark.parametrize(("holder", "source", "name"), FIELD_CASES)
def test_each_field_has_its_counterpart(holder: type, source: type, name: str) -> None:
    assert name in _names(holder), (
        f"{source.__name__} has the field {name!r} and {holder.__name__} does not: "
        "the lockstep compares the two records field by field"
    )


@pytest.mark.parametrize(("mine", "theirs"), PAIRS, ids=[t.__name__ for _, t in PAIRS])
def test_the_spec_records_are_its_own(mine: type, theirs: type) -> None:
    assert mine is not theirs and not issubclass(mine, theirs) and not issubclass(theirs, mine)
    assert mine.__module__ == "spec.records"


def test_fresh_statistics_agree_field_by_field() -> None:
    """S12: every counter starts at 0, on both sides."""
    assert_same_record(SpecSchedulerStats(), SchedulerStats(), "fresh statistics")
    assert set(dataclasses.asdict(SpecSchedulerStats()).values()) == {0}


# ---- the comparison fails, naming the field ------------------------------------------------


def test_the_comparison_names_a_field_the_spec_lacks() -> None:
    grown = dataclasses.make_dataclass(
        "GrownStats", [("recomputed_tokens", int, 0)], bases=(SchedulerStats,)
    )
    with pytest.raises(AssertionError, match=r"missing from the spec's.*\['recomputed_tokens'\]"):
        assert_same_record(SpecSchedulerStats(), grown(), "statistics")


def test_the_comparison_names_a_field_the_engine_lacks() -> None:
    shrunk = dataclasses.make_dataclass(
        "ShrunkStats", [(n, int, 0) for n in _names(SchedulerStats) if n != "failed_steps"]
    )
    with pytest.raises(AssertionError, match=r"missing from the engine's: \['failed_steps'\]"):
        assert_same_record(SpecSchedulerStats(), shrunk(), "statistics")


def test_the_comparison_names_each_differing_value() -> None:
    spec, engine = SpecSchedulerStats(steps=3, preemptions=1), SchedulerStats(steps=3)
    with pytest.raises(AssertionError) as caught:
        assert_same_record(spec, engine, "statistics")
    assert str(caught.value) == "statistics differ: preemptions: spec 1, engine 0"
    assert_same_record(SpecSchedulerStats(steps=3), engine, "statistics")  # the control


# ---- the translation at the boundary --------------------------------------------------------


def test_the_engine_marker_reaches_the_spec_as_its_own() -> None:
    assert spec_result(FailedSample("no finite logits")) == SpecFailedSample("no finite logits")
    assert spec_result(5) == 5 and spec_result(0) == 0 and spec_result(None) is None
    for wrong in (True, "7", SampleOutput(token=3)):
        with pytest.raises(TypeError, match="is not a token, None or a FailedSample"):
            spec_result(wrong)


def test_the_spec_refuses_the_engine_marker_untranslated() -> None:
    """Why the boundary translates: the spec knows only its own marker (S8)."""
    sched = SpecScheduler(
        SpecBlockManager(4, 2), max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8
    )
    seq = SpecRequest([1, 2, 3], 2, seq_id="s", max_tokens=2)
    sched.add(seq)
    batch, _ = sched.schedule()
    with pytest.raises(RuntimeError, match="the model returned FailedSample"):
        sched.postprocess(batch, [FailedSample("nan")])  # type: ignore[list-item]
    sched.recover()
    batch, _ = sched.schedule()
    assert sched.postprocess(batch, [SpecFailedSample("nan")]) == [seq]
    assert (sched.finish_reason(seq), sched.stop_reason(seq)) == ("error", "nan")


# ---- mutants: one statistic wrong, caught by the lockstep's comparison ----------------------


class EmptyingPreemptionUncounted(Scheduler):
    """A preemption that leaves no other sequence running (a sequence preempting itself,
    or the last victim) is not counted. Queues, tables and tokens are all right: only
    ``preemptions`` differs."""

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        if not self.running:
            self.stats.preemptions -= 1


def _hunt(scheduler_cls: type[Scheduler] = Scheduler) -> AssertionError:
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(make_machine(scheduler_cls), settings=HUNT)
    # The machine reports an engine that raised as a difference, with the exception as the
    # cause: a crash, not a catch by the comparison.
    crashed = caught.value.__cause__ is not None and str(caught.value).startswith("the engine's ")
    assert not crashed, f"caught only by a crash: {caught.value.__cause__!r}"
    return caught.value


def test_the_lockstep_catches_a_miscounted_preemption() -> None:
    caught = _hunt(EmptyingPreemptionUncounted)
    assert str(caught).startswith("statistics differ: preemptions: spec "), str(caught)


def test_the_lockstep_catches_a_wrong_statistics_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's ``SchedulerStats`` itself wrong (its ``steps`` start at 1), the
    scheduler's code right. While the spec borrowed that class, both sides started at 1
    and the lockstep passed; with the spec's own record it fails, naming ``steps``."""
    init = SchedulerStats.__init__

    def starts_at_one(self: SchedulerStats, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.steps += 1

    monkeypatch.setattr(SchedulerStats, "__init__", starts_at_one)
    assert SchedulerStats().steps == 1  # the mutant is in place
    caught = _hunt()
    assert str(caught).startswith("statistics differ: steps: spec 0, engine 1"), str(caught)
