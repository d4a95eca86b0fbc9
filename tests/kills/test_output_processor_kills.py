"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/output_processor.py,
through a whole engine: a fake model whose sampled results a test scripts per sequence,
and test_output_kills.py's byte tokenizer (a lead byte that waits for its continuation,
a special token).

Each section names what it kills (mutant names from the run, before issue 22 renamed the
output path: tests/equivalent_mutants.md maps them). The expected values are written out
by hand from the script; where a mutant would crash rather than answer differently, the
test compares the outcome (outputs, or the exception's type) so that a wrong answer is an
AssertionError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.request import Logprob, RequestOutput
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from tests.fake_model import FakeModelRunner
from tests.kills.test_llm_engine_kills import CONFIG, FailOnce
from tests.kills.test_output_kills import TOKEN_BYTES, ByteTokenizer

Result = int | FailedSample | SampleOutput


class Scripted(FakeModelRunner):
    """The fake model, whose sampled result for a sequence is the next item of its script
    (the fake's own token once the script runs out)."""

    def __init__(self) -> None:
        pool = CONFIG.num_kvcache_blocks
        assert pool is not None
        super().__init__(pool, CONFIG.kvcache_block_size, len(TOKEN_BYTES))
        self.script: dict[Sequence, list[Result]] = {}

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[Any]:
        out: list[Any] = super().run(seqs, is_prefill)
        for i, seq in enumerate(seqs):
            todo = self.script.get(seq)
            if out[i] is not None and todo:
                out[i] = todo.pop(0)
        return out


def _engine(scheduler_cls: Any = None) -> tuple[LLMEngine, Scripted]:
    runner = Scripted()
    extra = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
    engine = LLMEngine(
        runner,
        CONFIG,
        vocab_size=len(TOKEN_BYTES),
        eos_token_id=0,
        tokenizer=ByteTokenizer(),
        **extra,
    )
    return engine, runner


def _stream(
    params: SamplingParams, *scripts: list[Result], scheduler_cls: Any = None
) -> tuple[LLMEngine, list[list[RequestOutput]]]:
    """One request, prompt "a", its completions scripted; every step's outputs."""
    engine, runner = _engine(scheduler_cls)
    engine.add_request("r", [3], params)
    for seq, script in zip(engine.scheduler.waiting, scripts, strict=True):
        runner.script[seq] = list(script)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return engine, steps


def _outcome(run: Callable[[], Any]) -> Any:
    """What ``run`` returns, or the name of the exception it raises (so that a crash is a
    wrong answer that the caller's comparison reports)."""
    try:
        return run()
    except Exception as exc:  # compared by the caller, not swallowed
        return type(exc).__name__


def _final(params: SamplingParams, *scripts: list[Result]) -> Any:
    def run() -> Any:
        _, steps = _stream(params, *scripts)
        (out,) = steps[-1]
        return [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs]

    return _outcome(run)


LONG = {"ignore_eos": True}


# --------------------------------------------------------------------------------------------
# A sample that fails (FailedSample) ends the completion with the text it had, without the
# lead byte still waiting: kills _detokenize__mutmut_12 (the detokenizer reset when it is
# up to date: text ""), _15 and _16 (the "error" test never true: the lead byte flushed),
# _17 (text None), note__mutmut_33 (the scheduler's error record kept) and
# report__mutmut_4 (finished sequences kept in ``completion_of``).
# --------------------------------------------------------------------------------------------


def test_a_failed_sample_ends_with_the_text_so_far_and_leaves_no_records() -> None:
    params = SamplingParams(max_tokens=5, **LONG)
    engine, steps = _stream(params, [3, 1, FailedSample("nan")])
    (out,) = steps[-1]
    (c,) = out.outputs
    assert (c.text, c.finish_reason, c.token_ids) == ("a", "error", [3, 1])
    assert engine.scheduler.errors == {}
    assert engine.output_processor.completion_of == {}


# --------------------------------------------------------------------------------------------
# The last token: its text is flushed (a waiting lead byte comes out as U+FFFD) and
# searched for stop strings. Kills _detokenize__mutmut_23 (flushed on every step but the
# last), _24 (the flush replaces the new text: no stop search), _26 (flush(None)).
# --------------------------------------------------------------------------------------------


def test_the_last_token_is_flushed() -> None:
    params = SamplingParams(max_tokens=2, **LONG)
    assert _final(params, [3, 1]) == [("a\ufffd", "length", None)]


def test_the_last_tokens_text_is_searched_for_stop_strings() -> None:
    params = SamplingParams(max_tokens=2, stop=[" "], **LONG)
    assert _final(params, [3, 4]) == [("a", "stop", " ")]


# --------------------------------------------------------------------------------------------
# A completion ended by a stop token is not searched for stop strings: kills
# _detokenize__mutmut_28, _30, _31 (stop_terminated never true).
# --------------------------------------------------------------------------------------------


def test_a_stop_token_ending_is_not_searched_for_stop_strings() -> None:
    # The stop token's text is kept (include_stop_str_in_output), so a search would find
    # the stop string " " in it.
    params = SamplingParams(
        max_tokens=5, stop=[" "], stop_token_ids=[4], include_stop_str_in_output=True, **LONG
    )
    assert _final(params, [3, 4]) == [("a ", "stop", 4)]


# --------------------------------------------------------------------------------------------
# Stop strings count from the min_tokens-th token on: kills _detokenize__mutmut_36 (`>`).
# --------------------------------------------------------------------------------------------


def test_a_stop_string_in_the_min_tokens_th_token_stops() -> None:
    params = SamplingParams(max_tokens=3, min_tokens=2, stop=[" "], **LONG)
    # the first " " is before min_tokens; the second, in token 2, stops at index 1
    assert _final(params, [4, 4, 3]) == [(" ", "stop", " ")]


# --------------------------------------------------------------------------------------------
# finished_time is set when the request's last completion finishes, not before: kills
# _detokenize__mutmut_65 (set on a running request's first text) and _66 (set when any
# completion finishes).
# --------------------------------------------------------------------------------------------


def test_a_request_gets_its_finished_time_only_when_it_finishes() -> None:
    params = SamplingParams(n=2, max_tokens=3, stop=[" "], **LONG)
    _, steps = _stream(params, [4], [3, 3, 3])
    (first,) = steps[0]
    assert [c.finish_reason for c in first.outputs] == ["stop", None]
    assert (first.finished, first.metrics.finished_time) == (False, None)
    (last,) = steps[-1]
    assert last.finished and last.metrics.finished_time is not None


# --------------------------------------------------------------------------------------------
# A failed step's logprobs are overwritten by the recomputed ones: kills x__put__mutmut_2
# (the overwritten entry None).
# --------------------------------------------------------------------------------------------


def _lp(logprob: float) -> SampleOutput:
    return SampleOutput(3, TokenLogprobs(3, logprob, 1, ()))


def test_a_failed_steps_logprobs_are_replaced_by_the_recomputed_ones() -> None:
    params = SamplingParams(max_tokens=2, logprobs=0, **LONG)

    def run() -> Any:
        engine, runner = _engine(FailOnce)
        engine.add_request("r", [3], params)
        (seq,) = engine.scheduler.waiting
        runner.script[seq] = [_lp(-1.0), _lp(-2.0), _lp(-3.0)]
        engine.step()  # the prefill: token 1, logprob -1.0
        sched: Any = engine.scheduler
        sched.fail_seq = seq  # the decode's postprocess raises after store_logprobs stored -2.0
        assert _outcome(engine.step) == "RuntimeError"
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()  # recomputed: -3.0
        return outs[-1].outputs[0].logprobs

    assert _outcome(run) == [{3: Logprob(-1.0, 1, "a")}, {3: Logprob(-3.0, 1, "a")}]


# --------------------------------------------------------------------------------------------
# Logprobs are decoded as they arrive: prompt logprobs of a request without ``logprobs``
# (kills _detokenize__mutmut_4: then never decoded), and a stream's logprobs without a
# detokenizer (kills note__mutmut_24: decoded only once it finishes).
# --------------------------------------------------------------------------------------------


def test_prompt_logprobs_are_decoded_without_completion_logprobs() -> None:
    prompt = (TokenLogprobs(4, -1.0, 1, ()), TokenLogprobs(3, -2.0, 1, ()))
    engine, runner = _engine()
    engine.add_request("r", [3, 4, 3], SamplingParams(max_tokens=1, prompt_logprobs=0, **LONG))
    (seq,) = engine.scheduler.waiting
    runner.script[seq] = [SampleOutput(3, None, prompt)]
    (out,) = engine.step()
    assert out.finished
    assert out.prompt_logprobs == [None, {4: Logprob(-1.0, 1, " ")}, {3: Logprob(-2.0, 1, "a")}]


def test_a_streams_logprobs_are_decoded_each_step_without_a_detokenizer() -> None:
    params = SamplingParams(max_tokens=3, logprobs=0, detokenize=False, **LONG)
    engine, runner = _engine()
    engine.add_request("r", [3], params)
    (seq,) = engine.scheduler.waiting
    runner.script[seq] = [_lp(-1.0), _lp(-2.0), _lp(-3.0)]
    (first,) = engine.step()
    assert not first.finished
    assert first.outputs[0].logprobs == [{3: Logprob(-1.0, 1, None)}]
