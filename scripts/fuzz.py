"""A fuzz campaign: the Hypothesis machines with fresh random seeds until a time budget ends.

Usage: ``python scripts/fuzz.py [--minutes M] [--seed S] [--only PATTERN] [--list]``
(``tox -e fuzz -- --minutes 10``).

CI replays the same derandomised examples on every run (profile ``ci``); this is the other
half. Each round runs one machine (the machines take turns, so even a short budget reaches
every one) under the ``fuzz`` profile (tests/conftest.py: random generation, 100 examples
of up to 100 steps where the machine takes its budget from the profile, the example
database under .hypothesis/examples) with a new random seed passed as
``--hypothesis-seed``. The round's machine and seed are printed before it starts, and a
failing round prints the command that reruns it exactly. The database also keeps every
failure found, and any later run on this checkout with a profile that has the database
(fuzz, dev) tries it first. The campaign stops at the first failing round (exit 1) or when
the budget is spent (exit 0; a round cut off by the budget is reported as cut off, not as
a pass, and a budget too short for any round to finish exits 3).

``--seed S`` reruns: one round per selected machine with that seed, budget ignored.

The machines are the real code's state machines, not the mutant hunts (those are
derandomised on purpose): the allocator lockstep machine, the engine machine, the
attention machine's real lanes (and its mixed-step subclass), and the scheduler lockstep
machine.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# pytest node ids (files, or file::test) of the real-code machines; missing files are skipped
# so a machine added later only needs its line here.
MACHINES = (
    "tests/test_allocator_machine.py::TestAllocatorLockstep",
    "tests/test_allocator_machine.py::TestAllocatorLockstepCollidingHash",
    "tests/test_allocator_machine.py::TestAllocatorLockstepSmallBlocks",
    "tests/test_engine_machine.py",
    "tests/test_attention_machine.py::test_torch_backend_machine",
    "tests/test_attention_machine.py::test_triton_backend_machine_interpreted",
    "tests/test_attention_machine_mixed.py::test_mixed_steps_machine",
    "tests/test_scheduler_machine.py::TestSchedulerMachine",
)
# In a machine file that also hunts mutants, only the real code is fuzzed.
DESELECT = "not mutant"


def machines(only: str | None) -> list[str]:
    """The machine node ids whose file exists, filtered by ``only`` (a substring)."""
    found = [m for m in MACHINES if (ROOT / m.split("::")[0]).exists()]
    return [m for m in found if only is None or only in m]


def pytest_command(seed: int, targets: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "--no-header",
        "-x",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu",
        "-k",
        DESELECT,
        f"--hypothesis-seed={seed}",
        *targets,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument("--seed", type=int, help="run one round with this seed, then stop")
    parser.add_argument("--only", help="only the machines whose node id contains this")
    parser.add_argument("--list", action="store_true", help="print the machines and exit")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")

    targets = machines(args.only)
    if args.list:
        print("\n".join(targets))
        return 0
    if not targets:
        parser.error(f"no machine matches --only {args.only!r}")

    env = dict(os.environ, HYPOTHESIS_PROFILE="fuzz")
    deadline = time.monotonic() + args.minutes * 60
    rng = random.SystemRandom()
    rounds = passed = 0
    budget = "ignored (--seed)" if args.seed is not None else f"{args.minutes:g} min"
    print(f"fuzz: {len(targets)} machines, budget {budget}", flush=True)
    for target in targets:
        print(f"  {target}", flush=True)
    while True:
        remaining = deadline - time.monotonic()
        if args.seed is not None and rounds == len(targets):
            break
        if args.seed is None and remaining <= 0:
            break
        target = targets[rounds % len(targets)]
        seed = args.seed if args.seed is not None else rng.randrange(2**32)
        cmd = pytest_command(seed, [target])
        rounds += 1
        print(f"\nfuzz: round {rounds}, {target}, seed {seed}", flush=True)
        start = time.monotonic()
        try:
            # A seeded round ignores the budget: it is a reproduction, run to the end.
            result = subprocess.run(
                cmd, cwd=ROOT, env=env, timeout=None if args.seed is not None else remaining
            )
        except subprocess.TimeoutExpired:
            print(f"fuzz: budget spent {time.monotonic() - start:.0f} s into round {rounds}")
            print(f"fuzz: round {rounds} ({target}, seed {seed}) was cut off, not passed")
            break
        took = time.monotonic() - start
        if result.returncode == 5:
            print(f"fuzz: pytest collected no test in {target}: check the list (--list)")
            return 2
        if result.returncode != 0:
            print(f"\nfuzz: round {rounds} FAILED after {took:.0f} s: {target}, seed {seed}")
            print("reproduce it with:")
            print(f"  HYPOTHESIS_PROFILE=fuzz {shlex.join(['python', *cmd[1:]])}")
            print("(the example database under .hypothesis/ replays it on any later run too)")
            return 1
        passed += 1
        print(f"fuzz: round {rounds} passed in {took:.0f} s", flush=True)
    if passed == 0:
        print("\nfuzz: no round finished within the budget: give it more --minutes")
        return 3
    print(f"\nfuzz: {passed} complete rounds passed, no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
