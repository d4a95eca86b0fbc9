"""Every scheduler mutant (tests/scheduler_mutants.py) fails a machine's own check.

Caught means an AssertionError from a comparison or an invariant: a mutant that merely
crashes (IndexError, a stall's RuntimeError) or hangs is not caught. The scheduler
machine compares the engine's scheduler with the spec's, so it sees policy and
statistics; the engine machine compares whole engines with the model run alone, so it
sees what reaches the outputs. The real code passes both hunts at every budget a mutant
gets (``HUNT``; ``LONG_HUNTS`` on the scheduler machine), and the engine mutants fail the
engine tests that pin their behaviour.

Each mutant is built inside its own test, before the hunt: a patch that no longer
applies fails that one test with ``StaleMutant`` (never an AssertionError, so never
taken for a catch), naming the mutant and the hunk. ``from_patch``'s own refusals are
shown at the end, on patches written here (the applier's: tests/test_patch_mutants.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from tests import engine_machine, scheduler_machine
from tests import scheduler_mutants as m
from tests.patch_mutants import StaleMutant
from tests.scheduler_subclass_mutants import SUBCLASSES, ChunkFromPrompt, DecodePastTokenBudget
from tests.test_engine import (
    check_abort_forgets_the_request,
    check_liveness_with_the_smallest_legal_pool,
    check_run_stats_are_per_call,
)

HUNT = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)
LONG_HUNTS = {"DecodePastTokenBudget": 1000}
"""Mutants HUNT's 300 examples miss on the scheduler machine, with the budget that catches
each. DecodePastTokenBudget needs more decoding sequences than the token budget allows in
one step; Hypothesis used to reach that sooner by drawing constants it found in the
engine's source (tests/conftest.py now stops it, so that the examples are the same in every
process), and 1,000 examples catch it after 772 test cases. A hand-worked case
(``test_a_decode_step_keeps_to_the_token_budget``) catches it in three steps."""


def hunt(name: str) -> settings:
    return settings(HUNT, max_examples=LONG_HUNTS.get(name, HUNT.max_examples))


@pytest.mark.parametrize("name", m.SCHEDULER_MUTANTS)
def test_the_scheduler_machine_catches(name: str) -> None:
    mutant = m.build(name)  # outside pytest.raises: a stale mutant is no catch
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(scheduler_machine.make_machine(mutant), settings=hunt(name))
    # The machine reports an engine that raised as a difference; that is a crash, not a
    # catch by the comparison.
    assert caught.value.__cause__ is None or not str(caught.value).startswith("the engine's "), (
        f"{name} was caught only by crashing: {caught.value.__cause__!r}"
    )


def decode_steps_within_the_budget(scheduler_cls: type[Scheduler]) -> None:
    """S6 by hand, LONG_HUNTS' slow catch in three steps: a budget of 2 tokens prefills
    three one-token prompts over two steps, then decodes only two of the three."""
    sched = scheduler_cls(
        BlockManager(num_blocks=8, block_size=4),
        num_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=2,
        max_model_len=16,
    )
    seqs = [Sequence([n], block_size=4) for n in (1, 2, 3)]
    for seq in seqs:
        sched.add(seq)
    steps = []
    for _ in range(3):
        batch, is_prefill = sched.schedule()
        steps.append(([seqs.index(seq) for seq in batch], is_prefill))
        sched.postprocess(batch, [7] * len(batch))
    assert steps == [([0, 1], True), ([2], True), ([0, 1], False)]


def test_a_decode_step_keeps_to_the_token_budget() -> None:
    decode_steps_within_the_budget(Scheduler)
    with pytest.raises(AssertionError):
        decode_steps_within_the_budget(DecodePastTokenBudget)


@pytest.mark.parametrize("name", m.ENGINE_HUNTED)
def test_the_engine_machine_catches(name: str) -> None:
    mutant = m.build(name)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(engine_machine.make_machine(mutant), settings=HUNT)


def test_the_engine_machine_catches_an_abort_that_keeps_the_request() -> None:
    machine = engine_machine.make_machine(engine_cls=m.AbortKeepsRequest)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=HUNT)


@pytest.mark.parametrize("make", [scheduler_machine.make_machine, engine_machine.make_machine])
def test_the_real_code_passes_the_same_hunts(make: Callable[[], type]) -> None:
    budgets = {HUNT.max_examples}
    if make is scheduler_machine.make_machine:  # the only machine LONG_HUNTS run on
        budgets |= set(LONG_HUNTS.values())
    for budget in sorted(budgets):
        run_state_machine_as_test(make(), settings=settings(HUNT, max_examples=budget))


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
        check_liveness_with_the_smallest_legal_pool(ChunkFromPrompt)


# ---- the mutants' bookkeeping --------------------------------------------------------------


def test_every_mutant_is_hunted_once_and_every_patch_file_is_a_mutant() -> None:
    names = m.SCHEDULER_MUTANTS
    assert len(names) == len(set(names)) == len(SUBCLASSES) + len(m.PATCHES)
    assert set(names) == set(SUBCLASSES) | set(m.PATCHES)
    assert set(m.ENGINE_HUNTED) <= set(SUBCLASSES)
    assert sorted(p.stem for p in m.PATCH_DIR.glob("*.patch")) == sorted(m.PATCHES)


@pytest.mark.parametrize("name", sorted(SUBCLASSES))
def test_a_subclass_mutant_overrides_only_what_the_scheduler_has(name: str) -> None:
    """A method the scheduler renamed would leave its mutant overriding nothing: named
    here, at once, rather than as a hunt that finds no defect."""
    mutant = SUBCLASSES[name]
    overridden = {k for k, v in vars(mutant).items() if callable(v) and not k.startswith("__")}
    assert overridden, f"{name} overrides nothing"
    missing = sorted(k for k in overridden if not callable(getattr(m.Scheduler, k, None)))
    assert not missing, f"{name} overrides {missing}, which Scheduler no longer has"


@pytest.mark.parametrize("name", m.PATCHES)
def test_a_patch_mutant_is_the_scheduler_with_its_part_patched(name: str) -> None:
    mutant = m.build(name)
    assert issubclass(mutant, m.Scheduler) and mutant.__name__ == name
    patched = mutant.__mro__[1]
    assert patched.__module__ == f"scheduler_mutant_{name}"
    assert mutant.__doc__ and mutant.__doc__.startswith(name)  # the patch's description


# ---- from_patch refuses, by name, a patch that does not build a mutant ---------------------

HEADER = "--- a/paged_engine/engine/preemption.py\n+++ b/paged_engine/engine/preemption.py\n"
HUNK = (
    "@@ -35,3 +35,3 @@\n"
    "             while not block_manager.can_append(seq):\n"
    "                 if running:\n"
    "-                    victim = running[-1]  # S7: the most recently admitted\n"
    "+                    victim = running[0]\n"
)


def _patch(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}.patch").write_text(text, encoding="utf-8")
    return tmp_path


def test_a_well_formed_patch_builds_a_mutant(tmp_path: Path) -> None:
    """The control for the refusals below: the same hunk, as written, applies."""
    mutant = m.from_patch("VictimControl", _patch(tmp_path, "VictimControl", HEADER + HUNK))
    assert issubclass(mutant, m.Scheduler)
    assert mutant._schedule_decode is not m.Scheduler._schedule_decode


def test_a_stale_patch_fails_its_build_naming_the_mutant_and_the_hunk(tmp_path: Path) -> None:
    """The same hunk, its context reworded: the applier (tests/test_patch_mutants.py)
    refuses it, and ``from_patch`` lets that through, never an AssertionError."""
    stale = HUNK.replace("the most recently admitted", "the newest")
    text = "Stale (a test's): made up.\n\n" + HEADER + stale
    with pytest.raises(StaleMutant) as refused:
        m.from_patch("Stale", _patch(tmp_path, "Stale", text))
    assert (refused.value.mutant, refused.value.file, refused.value.hunk_header) == (
        "Stale",
        "paged_engine/engine/preemption.py",
        "@@ -35,3 +35,3 @@",
    )
    assert "victim = running[-1]  # S7: the newest" in str(refused.value)


def test_a_missing_patch_or_a_patch_outside_the_engine_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StaleMutant, match=r"mutant Gone: .*Gone\.patch: no such patch file"):
        m.from_patch("Gone", tmp_path)
    outside = HEADER.replace("engine/preemption", "config") + HUNK
    with pytest.raises(StaleMutant) as refused:
        m.from_patch("Outside", _patch(tmp_path, "Outside", outside))
    assert refused.value.file == "paged_engine/config.py"
    assert refused.value.reason == "not a module of paged_engine/engine/"
    with pytest.raises(KeyError, match="no scheduler mutant named 'Nameless'"):
        m.build("Nameless")
