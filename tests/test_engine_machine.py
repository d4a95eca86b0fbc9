"""The engine machine over the real scheduler (see tests/engine_machine.py)."""

from tests.engine_machine import make_machine

TestEngineMachine = make_machine().TestCase
