"""The lockstep machine must fail on every mutant allocator (proof the tests can fail)."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests import mutants
from tests.allocator_machine import make_machine

# (mutant, machine options): the options give the machine the conditions under which the
# rule matters (block size 1 for R7, a colliding hash for R10, xxh64 for R4's mutant,
# which hashes with xxh64 whatever it is asked); the machine finds the rest.
CASES = [
    (mutants.R2NoDeleteStaleHash, {}),
    (mutants.R2UnguardedDelete, {}),
    (mutants.R5LookupLastBlock, {}),
    (mutants.R3ForwardRelease, {}),
    (mutants.R1LifoReuse, {}),
    (mutants.R6ReviveWithoutRemoval, {}),
    (mutants.R6NoSharedIncrement, {}),
    (mutants.R4NoPrefixChain, {"hash_algorithms": ("xxh64",)}),
    (mutants.R10NoTokenVerification, {"hash_fn": mutants.colliding_hash}),
    (mutants.R7ModOneGrowth, {"block_sizes": (1,)}),
    (mutants.R4sSaltIgnored, {}),
    (mutants.R13KeepsBlockHashes, {}),
    (mutants.R13ResetWhileInUse, {}),
    (mutants.R13KeepsRememberedLookup, {}),
]

# No shrinking: we only need to know that a failing run exists, not its smallest form.
# 400 examples: derandomised, the slowest catch above comes at example 362
# (R2UnguardedDelete; R5LookupLastBlock and R13KeepsRememberedLookup at 249), and the real
# allocator is hunted with exactly this budget too, in each of the three machine setups.
HUNT = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)


@pytest.mark.parametrize(("mutant", "options"), CASES, ids=[c[0].__name__ for c in CASES])
def test_lockstep_machine_catches(mutant: type, options: dict) -> None:
    # Without the misuse rule: each catch comes from ordinary scheduler traffic, not from a
    # mutant's missing argument checks.
    # Caught means a failed comparison or invariant (AssertionError), not the mutant
    # crashing (a KeyError, say, would prove nothing about the machine).
    machine = make_machine(engine_factory=mutant, misuse=False, **options)
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
