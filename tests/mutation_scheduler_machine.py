"""The scheduler lockstep machine over the real scheduler, for mutmut's test selection only.

tests/test_scheduler_machine.py binds the same machine, with exact examples beside it.
This file once existed because that one imported mutants built by patching the
scheduler's source at import, which failed under mutmut's trampolined copy; mutants are
now built only inside the tests that hunt them (tests/scheduler_mutants.py), so either
file imports there. This one stays because pyproject.toml's [tool.mutmut] selection names
it, and changing that list resets every verdict mutmut has recorded. Its name does not
match ``test_*.py``, so the ordinary suite (which runs TestSchedulerMachine from
test_scheduler_machine.py) does not collect it twice.
"""

from __future__ import annotations

from tests.scheduler_machine import make_machine

TestSchedulerMachineForMutation = make_machine().TestCase
