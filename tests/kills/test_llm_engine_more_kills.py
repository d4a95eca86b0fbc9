"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/llm_engine.py:
the config's ``mixed_steps`` reaching the scheduler, a request whose queueing fails
halfway, and what ``generate`` leaves when it fails before its first step or in a step
that finished some of its requests.

Each section names what it kills. The expected values never come from the code under test:
they are written out by hand from the documented behaviour.
"""

from __future__ import annotations

from typing import Any

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeModelRunner
from tests.kills.test_llm_engine_kills import CONFIG
from tests.outcomes import outcome

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# --------------------------------------------------------------------------------------------
# The config's mixed_steps reaches the scheduler (docs/design.md S2m: each step decodes,
# then prefills in what is left): kills llm_engine.xǁLLMEngineǁ__init____mutmut_75
# (``mixed_steps=None``) and _83 (the keyword dropped: the scheduler's default, off). Either
# way the engine's steps are all-prefill or all-decode, so a request added while another
# decodes is prefilled in a step of its own.
# --------------------------------------------------------------------------------------------


def test_mixed_steps_in_the_config_put_a_decode_and_a_prefill_in_one_step() -> None:
    config = EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=40,
        kvcache_block_size=4,
        num_kvcache_blocks=16,
        mixed_steps=True,
    )
    runner = FakeModelRunner(16, 4, VOCAB)
    engine = LLMEngine(runner, config, vocab_size=VOCAB)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()  # a's prefill: 3 tokens
    engine.add_request("b", [1, 2, 3, 4, 1], GREEDY)
    engine.step()  # a's decode (1 token), then b's prefill (5) in what is left
    shapes = [(is_prefill, [n for _, n in batch]) for is_prefill, batch in runner.batches]
    assert shapes == [(True, [3]), (True, [1, 5])]


# --------------------------------------------------------------------------------------------
# Queueing that fails between a request's completions leaves none of them queued and
# propagates the failure itself (the ``except BaseException`` in ``_enqueue``, made for a
# KeyboardInterrupt there): kills llm_engine.xǁLLMEngineǁ_enqueue__mutmut_4
# (``abort_request(None)``, which raises TypeError over the failure and leaves the request
# in the engine).
# --------------------------------------------------------------------------------------------


class FailingAdd(Scheduler):
    """Raises on the ``fail_at``-th ``add`` (1 is the first), once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at: int | None = None
        self.adds = 0

    def add(self, seq: Sequence) -> None:
        self.adds += 1
        if self.adds == self.fail_at:
            raise RuntimeError("injected in add")
        super().add(seq)


def _failing_add(fail_at: int) -> tuple[LLMEngine, FailingAdd]:
    engine = build_engine(CONFIG, spec=False, scheduler_cls=FailingAdd)
    sched = engine.scheduler
    assert isinstance(sched, FailingAdd)
    sched.fail_at = fail_at
    return engine, sched


def test_a_request_whose_second_completion_cannot_be_queued_leaves_nothing_queued() -> None:
    engine, sched = _failing_add(2)
    params = SamplingParams(n=2, seed=1, max_tokens=4, ignore_eos=True)
    got = outcome(lambda: engine.add_request("r", [1, 2, 3], params))
    assert got == ("RuntimeError", "injected in add")
    assert not engine.has_unfinished_requests()
    assert list(sched.waiting) == []


# --------------------------------------------------------------------------------------------
# generate() failing before its first step (queueing its second request fails): the same
# exception propagates, with no partial outputs, and the engine is idle. Kills
# llm_engine.xǁLLMEngineǁ_run_to_completion__mutmut_7 (``progress = ""`` before the bar
# exists) and _48 (``if progress is None: progress.close()``): both raise AttributeError
# over the failure. The run's peak of blocks in use (S12: after each scheduled step) is 0,
# none having been scheduled: kills _run_to_completion__mutmut_5 (the peak reset to 1).
# --------------------------------------------------------------------------------------------


def test_generate_failing_before_its_first_step_propagates_the_failure() -> None:
    engine, sched = _failing_add(2)
    got = outcome(lambda: engine.generate([[1, 2, 3], [2, 3, 4]], GREEDY, use_tqdm=False))
    assert got == ("RuntimeError", "injected in add")
    assert not engine.has_unfinished_requests()
    assert list(sched.waiting) == []


def test_generate_failing_before_its_first_step_attaches_no_partial_outputs() -> None:
    engine, _ = _failing_add(1)
    try:
        engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    except Exception as exc:  # compared, so that another failure is a wrong answer
        got = (type(exc).__name__, getattr(exc, "partial_outputs", "none attached"))
    else:
        got = ("returned", None)
    assert got == ("RuntimeError", [])


def test_a_run_that_scheduled_nothing_had_no_block_in_use() -> None:
    engine, sched = _failing_add(2)
    got = outcome(lambda: engine.generate([[1, 2, 3], [2, 3, 4]], GREEDY, use_tqdm=False))
    assert got == ("RuntimeError", "injected in add")
    assert sched.stats.steps == 0
    assert sched.stats.peak_blocks_in_use == 0


# --------------------------------------------------------------------------------------------
# generate() failing in a step that finished a request: that request's output is in the
# exception's partial_outputs even when a request before it (in input order) had not
# finished. Kills llm_engine.xǁLLMEngineǁ_salvage__mutmut_5 (``break`` for ``continue``:
# the salvage stops at the first unfinished request).
# --------------------------------------------------------------------------------------------


class FailThirdStop(Scheduler):
    """Raises in the stop check of the third sequence checked, once (after the two before
    it in the batch have committed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checked = 0

    def _stops(self, seq: Sequence, token: int) -> bool:
        self.checked += 1
        if self.checked == 3:
            raise RuntimeError("injected in postprocess")
        return super()._stops(seq, token)


def test_a_request_finished_by_the_failing_step_is_salvaged_behind_an_unfinished_one() -> None:
    engine = build_engine(CONFIG, spec=False, scheduler_cls=FailThirdStop)
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # runs on
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),  # done at its prefill
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # its check raises
    ]
    try:
        engine.generate([[1, 2, 3], [2, 3, 4], [3, 4, 1]], params, use_tqdm=False)
    except RuntimeError as exc:
        assert str(exc) == "injected in postprocess"
        partial = exc.partial_outputs  # type: ignore[attr-defined]
    else:
        raise AssertionError("generate did not raise")
    got = [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in partial]
    assert got == [("1", True, 1)]
    assert not engine.has_unfinished_requests()
