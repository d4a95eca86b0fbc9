"""The scheduler lockstep machine over the real scheduler, for mutmut's test selection only.

tests/test_scheduler_machine.py binds the same machine, but it also imports
tests/scheduler_mutants.py, whose patched-source mutants read the scheduler's source with
``inspect.getsource``: under mutmut that source is the trampolined copy, where every edit's
text occurs once per mutant, so the module fails to import. This file binds the machine
alone. Its name does not match ``test_*.py``, so the ordinary suite (which runs
TestSchedulerMachine from test_scheduler_machine.py) does not collect it twice; mutmut
collects it because [tool.mutmut] names it explicitly.
"""

from __future__ import annotations

from tests.scheduler_machine import make_machine

TestSchedulerMachineForMutation = make_machine().TestCase
