"""The lockstep machine must fail on every mutant allocator (proof the tests can fail).

Each mutant has its own test, which builds it (tests/allocator_mutants: a patch applied
to a copy of the allocator's source, or a subclass): a patch that no longer applies fails
that one test, naming the mutant and the hunk.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.sequence import Sequence
from tests import allocator_mutants as mutants
from tests.allocator_machine import make_machine
from tests.patch_mutants import StaleMutant, read_patch

# (mutant, machine options): the options give the machine the conditions under which the
# rule matters (block size 1 for R7, a colliding hash for R10, xxh64 for R4's mutant,
# and R8's, which break only xxh64's paths); the machine finds the rest.
CASES = {
    "R2NoDeleteStaleHash": {},
    "R2UnguardedDelete": {},
    "R5LookupLastBlock": {},
    "R3ForwardRelease": {},
    "R1LifoReuse": {},
    "R6ReviveWithoutRemoval": {},
    "R6NoSharedIncrement": {},
    "R4NoPrefixChain": {"hash_algorithms": ("xxh64",)},
    "R10NoTokenVerification": {"hash_fn": mutants.colliding_hash},
    "R7ModOneGrowth": {"block_sizes": (1,)},
    "R4sSaltIgnored": {},
    "R13KeepsBlockHashes": {},
    "R13ResetWhileInUse": {},
    "R13KeepsRememberedLookup": {},
    "R8DecodeStepNotRegistered": {"hash_algorithms": ("xxh64",)},
}
HUNTED_ELSEWHERE = {"MemoIgnoresLength": "tests/test_invariants.py"}
"""Patch mutants the machine cannot reach (its sequences never grow between lookups),
caught by a test written for them."""

# No shrinking: we only need to know that a failing run exists, not its smallest form.
# 400 examples: derandomised, the slowest catch above comes after 220 test cases
# (R2UnguardedDelete; R5LookupLastBlock after 150) where the real allocator's hunt runs
# 1,041 (counted as `Lockstep`s built, one per test case run). That is the same in any
# process since tests/conftest.py keeps Hypothesis from drawing the loaded modules'
# constants (before, R2UnguardedDelete's catch came at example 362 in a full run and past
# 1,000 after other tests' imports). The real allocator is hunted with exactly this budget
# too, in each of the three machine setups.
HUNT = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)


@pytest.mark.parametrize("name", list(CASES))
def test_lockstep_machine_catches(name: str, tmp_path: Path) -> None:
    mutant = mutants.allocator(name, tmp_path)  # a stale patch fails here, by name
    # Without the misuse rule: each catch comes from ordinary scheduler traffic, not from a
    # mutant's missing argument checks.
    # Caught means a failed comparison or invariant (AssertionError), not the mutant
    # crashing (a KeyError, say, would prove nothing about the machine).
    machine = make_machine(engine_factory=mutant, misuse=False, **CASES[name])
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=HUNT)


def test_the_real_allocator_passes_the_same_hunt() -> None:
    """The same settings must not fail the engine itself (or the catches above mean nothing):
    the same example budget as every mutant, in each setup the mutants use."""
    hunt = HUNT
    run_state_machine_as_test(make_machine(misuse=False), settings=hunt)
    run_state_machine_as_test(
        make_machine(misuse=False, hash_fn=mutants.colliding_hash), settings=hunt
    )
    run_state_machine_as_test(make_machine(misuse=False, block_sizes=(1,)), settings=hunt)


def test_an_unpatched_copy_passes_a_hunt(tmp_path: Path) -> None:
    """The patch mutants' loading alone breaks nothing: the allocator's modules copied and
    imported as a patch mutant's are, without a patch, pass the machine (with misuse), so
    a patch mutant's catch comes from its patch."""
    modules = mutants.patched_modules("", tmp_path)
    copy = modules["paged_engine.engine.block_manager"].BlockManager
    assert copy is not BlockManager and copy.__module__ == BlockManager.__module__
    assert Path(modules["paged_engine.engine.block_pool"].__file__ or "").is_relative_to(tmp_path)
    # the copies import each other, not the real modules
    assert copy.__mro__[1] is modules["paged_engine.engine.block_pool"].BlockPool
    hunt = settings(HUNT, max_examples=100)
    run_state_machine_as_test(make_machine(engine_factory=copy), settings=hunt)
    run_state_machine_as_test(
        make_machine(engine_factory=copy, hash_fn=mutants.colliding_hash), settings=hunt
    )


def test_loading_a_patch_mutant_leaves_the_real_modules_in_place(tmp_path: Path) -> None:
    before = {m: sys.modules[m] for m in mutants.ALLOCATOR_MODULES}
    mutant = mutants.allocator("R1LifoReuse", tmp_path)
    assert {m: sys.modules[m] for m in mutants.ALLOCATOR_MODULES} == before
    # The mutant hands out the queue's tail; the real allocator, imported after, its head.
    for cls, expected in ((mutant, [3]), (BlockManager, [0])):
        bm = cls(4, 2)
        seq = Sequence([1], block_size=2)
        bm.allocate(seq, 0)
        assert seq.block_table == expected, cls


def test_every_patch_mutant_is_hunted() -> None:
    patches = set(mutants.patch_names())
    assert patches == (set(CASES) | set(HUNTED_ELSEWHERE)) - set(mutants.SUBCLASS_MUTANTS)
    assert not patches & set(mutants.SUBCLASS_MUTANTS)
    for name in patches:  # each says what it breaks, starting with its name and rule
        patch = read_patch(name, mutants.PATCHES / f"{name}.diff")
        assert patch.description.startswith(f"{name}: R"), name


# ---- a stale patch fails loudly, naming itself (the applier: tests/test_patch_mutants.py) -----


def test_a_stale_patch_mutant_fails_naming_itself_and_leaves_the_modules_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch written for an older block_pool.py: building that mutant raises, and the
    real modules stay in place (other mutants and tests are unaffected)."""
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "R0Stale.diff").write_text(
        "R0Stale: R2 against a block pool that no longer exists.\n\n"
        "--- a/paged_engine/engine/block_pool.py\n+++ b/paged_engine/engine/block_pool.py\n"
        "@@ -1,2 +1,2 @@\n"
        "-    def _fresh_block(self) -> int:\n+    def _stale_block(self) -> int:\n"
        "         block = next(iter(self.free_blocks))\n"
    )
    monkeypatch.setattr(mutants, "PATCHES", patches)
    before = {m: sys.modules[m] for m in mutants.ALLOCATOR_MODULES}
    with pytest.raises(StaleMutant) as caught:
        mutants.allocator("R0Stale", tmp_path / "build")
    assert str(caught.value).startswith(
        "mutant R0Stale: paged_engine/engine/block_pool.py, hunk @@ -1,2 +1,2 @@: "
        "its lines occur 0 times, not once"
    )
    assert {m: sys.modules[m] for m in mutants.ALLOCATOR_MODULES} == before
    # A patch of a module outside the allocator's is refused, naming it.
    (patches / "R0Outside.diff").write_text(
        "R0Outside: a patch of the scheduler.\n\n"
        "--- a/paged_engine/engine/scheduler.py\n+++ b/paged_engine/engine/scheduler.py\n"
        "@@ -1,1 +1,1 @@\n-from __future__ import annotations\n+from __future__ import division\n"
    )
    with pytest.raises(StaleMutant) as outside:
        mutants.allocator("R0Outside", tmp_path / "outside")
    assert (outside.value.mutant, outside.value.file) == (
        "R0Outside",
        "paged_engine/engine/scheduler.py",
    )
    assert outside.value.reason == "outside the allocator's modules"
    assert {m: sys.modules[m] for m in mutants.ALLOCATOR_MODULES} == before


def test_an_unknown_mutant_is_a_key_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="no mutant 'R99'"):
        mutants.allocator("R99", tmp_path)
