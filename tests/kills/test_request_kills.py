"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/request.py:
``Request.build_output``'s held-back text and its logprob fields, on hand-built records
(mutant names from the run, when it was ``Request.output``).

Each section names what it kills; the expected outputs are written out by hand.
"""

from __future__ import annotations

from paged_engine.engine.outputs import TokenLogprobs
from paged_engine.engine.request import Completion, Request
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams


def _request(params: SamplingParams, text: str, **completion: object) -> Request:
    """A running request whose one completion has sampled tokens 7, 8, 9 and ``text``."""
    seq = Sequence([1, 2, 3], params, block_size=4)
    for token in (7, 8, 9):
        seq.append_token(token)
    c = Completion(index=0, seq=seq, detokenizer=None, text=text, **completion)  # type: ignore[arg-type]
    return Request("r", None, [1, 2, 3], params, [c])


# --------------------------------------------------------------------------------------------
# While a completion runs, the last len(longest stop) - 1 characters are held back: kills
# xǁRequestǁoutput__mutmut_9 (+1), 15 (-2) and 26 (a text shorter than the hold keeps its
# first character).
# --------------------------------------------------------------------------------------------


def test_running_text_holds_back_one_character_less_than_the_longest_stop() -> None:
    params = SamplingParams(stop=("abc", "xy"), max_tokens=10)
    assert _request(params, "hello wor").build_output()[0].outputs[0].text == "hello w"
    assert _request(params, "he").build_output()[0].outputs[0].text == ""
    assert _request(params, "h").build_output()[0].outputs[0].text == ""
    finished = _request(params, "hello wor", finish_reason="length")
    assert finished.build_output()[0].outputs[0].text == "hello wor"  # nothing held once finished


# --------------------------------------------------------------------------------------------
# Logprob fields: None unless asked for; when asked, the sum over the completion's tokens:
# kills xǁRequestǁoutput__mutmut_32, 33 ("" for None), 36 and 42 (the sum dropped).
# --------------------------------------------------------------------------------------------


def test_logprob_fields_are_none_unless_asked_and_the_sum_when_asked() -> None:
    out = _request(SamplingParams(max_tokens=10), "abc").build_output()[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None
    lps = [TokenLogprobs(t, lp, 1, ()) for t, lp in ((7, -0.5), (8, -1.25), (9, -2.0))]
    decoded = [{7: "a"}, {8: "b"}, {9: "c"}]
    asked = _request(
        SamplingParams(max_tokens=10, logprobs=0), "abc", logprobs=lps, decoded_logprobs=decoded
    )
    out = asked.build_output()[0].outputs[0]
    assert out.cumulative_logprob == -3.75  # -0.5 - 1.25 - 2.0, exact in binary
    assert out.logprobs == decoded
    assert out.token_ids == [7, 8, 9]


# --------------------------------------------------------------------------------------------
# prompt_logprobs: None unless asked for: kills xǁRequestǁoutput__mutmut_76 (an empty list).
# --------------------------------------------------------------------------------------------


def test_prompt_logprobs_are_none_unless_asked() -> None:
    assert _request(SamplingParams(max_tokens=10), "abc").build_output()[0].prompt_logprobs is None
    asked = _request(SamplingParams(max_tokens=10, prompt_logprobs=0), "abc")
    asked.decoded_prompt_logprobs = [None, {2: "b"}, {3: "c"}]
    assert asked.build_output()[0].prompt_logprobs == [None, {2: "b"}, {3: "c"}]
