"""The attention machine with mixed steps too (S2m, docs/design.md): a rule that decodes the
running sequences and prefills chunks in one batch, decodes first, as the scheduler builds
a mixed step.

A subclass of tests/attention_machine.py's machine rather than a rule in it: Hypothesis
derives a derandomised run's seed from the machine class's source, so a new rule there
would change every existing hunt's examples (and their catches). Here the base class and
its hunts stay as they are; only the machines made by ``make_mixed_machine`` draw the new
rule, among the others.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tests.attention_machine import Live, MachineConfig, make_machine


def make_mixed_machine(config: MachineConfig) -> type[RuleBasedStateMachine]:
    """``make_machine(config)`` plus the ``mixed_step`` rule."""
    base: Any = make_machine(config)

    class MixedAttentionMachine(base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._decodes: list[Live] = []  # a mixed step's decodes, until _run_step

        @precondition(
            lambda self: bool(self._decoding()) and (bool(self.waiting) or bool(self._prefilling()))
        )
        @rule(data=st.data())
        def mixed_step(self, data: st.DataObject) -> None:
            """Every decoding sequence the pool can grow without a preemption decodes one
            token, then ``prefill_step`` picks and chunks as it does alone; its batch runs
            with the decodes in front (``_run_step`` below). With no chunk picked the decodes
            run as a decode step of their own."""
            decodes: list[Live] = []
            for live in self._decoding():
                if self.bm.can_append(live.seq):
                    self.bm.may_append(live.seq)
                    live.seq.num_scheduled_tokens = 1
                    decodes.append(live)
            if not decodes:
                return
            self._decodes = decodes
            self.prefill_step(data)
            if self._decodes:  # prefill_step ran nothing
                self._decodes = []
                self._run_step(decodes, is_prefill=False)
            for live in decodes:
                self.bm.hash_blocks(live.seq)
                live.seq.num_cached_tokens += 1
                self._sample(live, data)

        def _run_step(self, batch: list[Live], is_prefill: bool) -> None:
            decodes, self._decodes = self._decodes, []
            super()._run_step([*decodes, *batch], is_prefill)

    MixedAttentionMachine.__name__ = base.__name__ + "_mixed"
    return MixedAttentionMachine
