"""More tests that kill mutants mutmut (tox -e mutation) found alive in
engine/output_processor.py, through a whole engine on test_output_processor_kills.py's
scripted fake model and test_output_kills.py's byte tokenizer.

They cover: DELTA counts of several requests in one step, FINAL_ONLY with ``n > 1``, the
prompt logprobs of a one-token prompt, an ``add_request`` whose queueing fails halfway, and
a completion's text taken again after an interruption (the module docstring: "Every stage
can be interrupted (an exception or a KeyboardInterrupt at any call) and run again to the
same result"; tests/fault_tracing.py injects such faults at every Python call of a run).

Expected values are written out by hand from the scripts; where a mutant would crash, the
test compares the outcome (the exception's type and message) so that a wrong answer is an
AssertionError.
"""

from __future__ import annotations

import sys
from typing import Any

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import Request, RequestOutput
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.kills.test_output_processor_kills import _engine, _stream
from tests.outcomes import outcome

LONG: dict[str, Any] = {"ignore_eos": True}


# --------------------------------------------------------------------------------------------
# Two DELTA requests reported in one step each get their own counts applied: kills
# output_processor.xǁOutputProcessorǁcollect_outputs__mutmut_12 (`sent = counts`: only the
# last request's counts are applied, so the first one's next delta repeats its tokens).
# --------------------------------------------------------------------------------------------


def test_delta_outputs_of_two_requests_in_one_step_each_hold_only_their_new_tokens() -> None:
    def run() -> Any:
        engine, runner = _engine()
        params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA, **LONG)
        engine.add_request("x", [3], params)
        engine.add_request("y", [3], params)
        sx, sy = engine.scheduler.waiting
        runner.script[sx] = [3, 4]  # "a", " "
        runner.script[sy] = [4, 3]  # " ", "a"
        steps = []
        while engine.has_unfinished_requests():
            steps.append(
                [(o.request_id, o.outputs[0].token_ids, o.outputs[0].text) for o in engine.step()]
            )
        return steps

    assert outcome(run) == [
        [("x", [3], "a"), ("y", [4], " ")],
        [("x", [4], " "), ("y", [3], "a")],
    ]


# --------------------------------------------------------------------------------------------
# FINAL_ONLY: step() reports nothing before the request ends, not even when one of its n
# completions ends first (collect_outputs' comment). Kills
# output_processor.xǁOutputProcessorǁcollect_outputs__mutmut_5 (`final_only = None`) and
# collect_outputs__mutmut_8 (`report_running or not final_only`): both report the request
# when its first completion ends.
# --------------------------------------------------------------------------------------------


def test_final_only_reports_an_n2_request_once_when_its_last_completion_ends() -> None:
    params = SamplingParams(
        n=2, max_tokens=3, stop_token_ids=(4,), output_kind=RequestOutputKind.FINAL_ONLY, **LONG
    )

    def run() -> Any:
        _, steps = _stream(params, [4], [3, 3, 3])  # completion 0 stops at its first token
        return [
            [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in step] for step in steps
        ]

    assert outcome(run) == [[], [], [[([4], "stop"), ([3, 3, 3], "length")]]]


# --------------------------------------------------------------------------------------------
# A one-token prompt's prompt logprobs are [None] (position 0 has none, as in vLLM): kills
# output_processor.xǁOutputProcessorǁ_decode_logprobs__mutmut_27 (`decoded[+1]`) and
# _decode_logprobs__mutmut_28 (`decoded[-2]`), which index past a one-entry list.
# --------------------------------------------------------------------------------------------


def test_a_one_token_prompts_prompt_logprobs_are_one_none() -> None:
    def run() -> Any:
        engine, _ = _engine()
        engine.add_request("r", [3], SamplingParams(max_tokens=1, prompt_logprobs=0, **LONG))
        (out,) = engine.step()
        return out.finished, out.prompt_logprobs

    assert outcome(run) == (True, [None])


# --------------------------------------------------------------------------------------------
# add_request whose queueing fails at its first completion (the scheduler raises; a
# KeyboardInterrupt between completions is the case _enqueue names): the request is
# aborted, the completions not yet recorded included, and the scheduler's exception is
# what propagates. Kills output_processor.xǁOutputProcessorǁforget__mutmut_6
# (`completion_of.pop(c.seq)` without a default: a KeyError for the second completion,
# never recorded, replaces the exception).
# --------------------------------------------------------------------------------------------


class AddFails(Scheduler):
    """A scheduler whose ``add`` raises on its first call."""

    calls = 0

    def add(self, seq: Sequence) -> None:
        AddFails.calls += 1
        if AddFails.calls == 1:
            raise RuntimeError("the scheduler's add failed")
        super().add(seq)


def test_an_add_request_that_fails_halfway_leaves_nothing_and_raises_the_failure() -> None:
    AddFails.calls = 0
    engine, _ = _engine(AddFails)

    def add() -> Any:
        engine.add_request("r", [3], SamplingParams(n=2, max_tokens=1, **LONG))

    assert outcome(add) == ("RuntimeError", "the scheduler's add failed")
    assert engine.has_unfinished_requests() is False
    assert engine.output_processor.completion_of == {}
    assert list(engine.scheduler.waiting) == []


# --------------------------------------------------------------------------------------------
# An interruption right after a completion's text is final (at the ``request.finished``
# call in ``_detokenize``, a Python call: the fault points of tests/fault_tracing.py)
# leaves the completion in ``needs_text``; the next step takes its text again and must
# give the same. Kills
# - output_processor.xǁOutputProcessorǁ_extend_text__mutmut_3 (`!=`), _4 ("XXstopXX") and
#   _5 ("STOP"): a completion a stop string ended is no longer left as it is, and its text
#   becomes the detokenizer's whole text, the stop string included;
# - _extend_text__mutmut_6 (`>=`: the detokenizer reset when it is up to date): the text is
#   searched again from its start, and a stop string that came before min_tokens (not a
#   stop then) now ends the completion.
# --------------------------------------------------------------------------------------------


class Interrupted(Exception):
    pass


def _interrupt_once_in_detokenize(monkeypatch: Any) -> None:
    """``Request.finished`` raises once, when ``_detokenize`` asks it (the completion's
    text and ending are set by then)."""
    real = vars(Request)["finished"].fget
    assert real is not None
    state = {"armed": True}

    def finished(self: Request) -> bool:
        # "in": under mutmut the caller is its renamed copy (``...ǁ_detokenize__mutmut_orig``)
        if state["armed"] and "_detokenize" in sys._getframe(1).f_code.co_name:
            state["armed"] = False
            raise Interrupted("interrupted")
        return bool(real(self))

    monkeypatch.setattr(Request, "finished", property(finished))


def _run_interrupted(
    engine: LLMEngine, monkeypatch: Any, interrupt_at_step: int
) -> list[list[RequestOutput]]:
    """Every step's outputs; step ``interrupt_at_step`` (from 0) is interrupted once and
    stepped again (its outputs are the ones of the step that follows)."""
    steps: list[list[RequestOutput]] = []
    while engine.has_unfinished_requests():
        if len(steps) == interrupt_at_step:
            _interrupt_once_in_detokenize(monkeypatch)
            try:
                engine.step()
            except Interrupted:
                pass
            else:
                raise AssertionError("the step was not interrupted")
        steps.append(engine.step())
    return steps


def test_a_stop_strings_cut_survives_an_interruption_after_it(monkeypatch: Any) -> None:
    def run() -> Any:
        engine, runner = _engine()
        engine.add_request("r", [3], SamplingParams(max_tokens=5, stop=(" ",), **LONG))
        (seq,) = engine.scheduler.waiting
        runner.script[seq] = [3, 4, 3]  # "a", " ": the stop string ends it at 1 character
        steps = _run_interrupted(engine, monkeypatch, interrupt_at_step=1)
        (out,) = steps[-1]
        return [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs], out.finished

    assert outcome(run) == ([("a", "stop", " ")], True)


def test_an_interruption_does_not_search_text_from_before_min_tokens_again(
    monkeypatch: Any,
) -> None:
    def run() -> Any:
        engine, runner = _engine()
        params = SamplingParams(max_tokens=2, min_tokens=2, stop=(" ",), **LONG)
        engine.add_request("r", [3], params)
        (seq,) = engine.scheduler.waiting
        runner.script[seq] = [4, 3]  # " " (token 1: before min_tokens, no stop), "a"
        steps = _run_interrupted(engine, monkeypatch, interrupt_at_step=1)
        (out,) = steps[-1]
        return [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs], out.finished

    assert outcome(run) == ([(" a", "length", None)], True)
