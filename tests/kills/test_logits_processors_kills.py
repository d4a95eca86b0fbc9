"""Tests that kill mutants mutmut (tox -e mutation) found alive in the logit processors
(layers/logits_processors.py), after tests/kills/test_sampling_kills.py's round.

Each section names what it kills (names under ``paged_engine.layers.``). The expected values
never come from the code under test: they are written out by hand from the documented
behaviour. The survivors that are equivalent, or that only a GPU can tell apart, are argued
in tests/equivalent_mutants.md.
"""

from __future__ import annotations

import pytest
import torch

from paged_engine.layers.logits_processors import _flat_ids, apply_logits_processors, processes
from paged_engine.sampling_params import SamplingParams
from paged_engine.utils.loader import _default_dtype
from tests.kills.test_sampling_kills import History, _logits
from tests.outcomes import outcome

# --------------------------------------------------------------------------------------------
# Which rows need a processor (``processes``): a plain row without history needs none, and a
# row whose min_tokens is reached needs none. Kills logits_processors.x_processes__mutmut_4
# (``min_tokens > 0 or (...)``: a plain row without history processed), _5
# (``min_tokens >= 0``: the same) and _8 (``history is not None or ...``: a row whose
# min_tokens is reached still processed).
# --------------------------------------------------------------------------------------------


def test_a_plain_row_without_history_needs_no_processor() -> None:
    assert processes(SamplingParams(), None) is False
    assert processes(SamplingParams(), History([1, 2], [3])) is False


def test_min_tokens_needs_a_processor_only_until_it_is_reached() -> None:
    params = SamplingParams(min_tokens=2)
    assert processes(params, History([7], [4, 5])) is False  # reached
    assert processes(params, History([7], [4, 5, 6])) is False
    assert processes(params, History([7], [])) is True
    assert processes(params, History([7], [4])) is True  # 1 output token < 2
    assert processes(params, None) is True  # unknown progress: apply_logits_processors decides


# --------------------------------------------------------------------------------------------
# _flat_ids' indices land on the device asked for (the logits' device, where _counts'
# bincount runs). The meta device stands in for a GPU: _flat_ids needs no values on it (its
# callers do, so they cannot be run there). Kills logits_processors.x__flat_ids__mutmut_28
# (``.to(None, ...)``) and _30 (``.to(non_blocking=True)``), which leave them on the host.
# --------------------------------------------------------------------------------------------


def test_flat_ids_are_row_major_indices_on_the_device_asked_for() -> None:
    rows = [(0, [1, 2]), (1, [0, 5])]  # token 5 is beyond a 3-token vocabulary: dropped
    on_host = _flat_ids(rows, 3, torch.device("cpu"))
    assert on_host.tolist() == [1, 2, 3]  # 0 * 3 + 1, 0 * 3 + 2, 1 * 3 + 0
    on_meta = _flat_ids(rows, 3, torch.device("meta"))
    assert on_meta.device.type == "meta"
    assert on_meta.shape == (3,)


# --------------------------------------------------------------------------------------------
# The min_tokens mask's index tensors follow the logits, not torch's default device (a
# caller may have set one, e.g. torch.set_default_device). Kills
# logits_processors.x_apply_logits_processors__mutmut_59, _61 (the row indices on the
# default device: ``device=None``, ``device=`` dropped), _63 and _65 (the token indices).
# With a meta default device such an index writes nothing into CPU logits, silently: the
# stop ids would stay samplable.
# --------------------------------------------------------------------------------------------


def test_the_min_tokens_mask_ignores_torchs_default_device() -> None:
    logits = _logits([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    params = [SamplingParams(), SamplingParams(min_tokens=2, stop_token_ids=[1])]
    with torch.device("meta"):
        out = apply_logits_processors(logits, params, [None, History([0], [])], (2,))
    assert out.device.type == "cpu"
    # row 1 has 0 of its 2 tokens: its stop id 1 and the eos id 2 masked; row 0 untouched
    assert out.tolist() == [[1.0, 1.0, 1.0], [1.0, float("-inf"), float("-inf")]]


# --------------------------------------------------------------------------------------------
# logit_bias is added in float32 whatever torch's default dtype (the loader sets it to the
# model's dtype while it builds a model; a user may set it for a session). Kills
# logits_processors.x_apply_logits_processors__mutmut_89 (``dtype=None``) and _92
# (``dtype=`` dropped): the bias tensor in the default dtype.
# --------------------------------------------------------------------------------------------


def test_logit_bias_is_added_in_float32_under_a_float64_default_dtype() -> None:
    # 2**-24 + 2**-50 rounds to 2**-24 in float32; 1 + 2**-24 is then exactly halfway
    # between 1 and the next float32 (1 + 2**-23), and ties go to even: 1.0. Added in
    # float64 first, the sum lies above halfway and rounds up instead.
    with _default_dtype(torch.float64):
        out = apply_logits_processors(
            _logits([1.0, 3.0]), [SamplingParams(logit_bias={0: 2.0**-24 + 2.0**-50})], [None]
        )
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.0, 3.0]]


def test_logit_bias_is_added_in_float32_under_a_bfloat16_default_dtype() -> None:
    # 0.1 in float32 is 13421773 * 2**-27 = 0.100000001490116...; in bfloat16 it would be
    # 0.10009765625.
    with _default_dtype(torch.bfloat16):
        out = apply_logits_processors(
            _logits([0.0, 2.0]), [SamplingParams(logit_bias={0: 0.1, 1: -0.5})], [None]
        )
    assert out.dtype == torch.float32
    assert out.tolist() == [[13421773 * 2.0**-27, 1.5]]


# --------------------------------------------------------------------------------------------
# A row without bad words does not end the bad-words pass: the rows after it still get
# theirs. Kills logits_processors.x__apply_bad_words__mutmut_11 (``continue`` as ``break``).
# --------------------------------------------------------------------------------------------


def test_bad_words_apply_to_rows_after_a_row_without_any() -> None:
    params = [
        SamplingParams(logit_bias={0: 1.0}),  # processed, but has no bad words
        SamplingParams(bad_words_token_ids=[[2]]),  # a one-token word: always banned
    ]
    out = apply_logits_processors(_logits([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]), params, [None] * 2)
    assert out.tolist() == [[2.0, 1.0, 1.0], [1.0, 1.0, float("-inf")]]


# --------------------------------------------------------------------------------------------
# The allowed_token_ids and bad_words masks follow the logits, not torch's default device.
# Kills logits_processors.x__apply_allowed__mutmut_8, _12 (the banned-token mask on the
# default device), _23, _25 (the rows' index there), and x__apply_bad_words__mutmut_43
# (``dev = None``), _46, _48 (its row index on the default device) and _50, _52 (its token
# index). Under a meta default device each raises or writes nothing into the CPU logits.
# --------------------------------------------------------------------------------------------


def test_allowed_tokens_and_bad_words_ignore_torchs_default_device() -> None:
    row = [1.0, 2.0, 3.0, 4.0, 5.0]
    params = [
        SamplingParams(allowed_token_ids=[0, 2]),
        SamplingParams(bad_words_token_ids=[[4, 1], [3]]),  # [4, 1]: after 4, ban 1
        SamplingParams(),
    ]
    logits = _logits(row, row, row)
    with torch.device("meta"):
        out = outcome(
            lambda: apply_logits_processors(
                logits, params, [None, History([0], [4]), None]
            ).tolist()
        )
    inf = float("-inf")
    assert out == [[1.0, inf, 3.0, inf, inf], [1.0, inf, 3.0, inf, 5.0], row]


# --------------------------------------------------------------------------------------------
# An allowed token or a bad word beyond the vocabulary is refused, naming its field, before
# any logit changes. Kills logits_processors.x__check_row__mutmut_24, _25 (the field's name
# in the message changed) and _26 (the allowed_token_ids check skipped: an IndexError from
# deep inside instead), and the same three for bad_words (_29, _30, _31).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            SamplingParams(allowed_token_ids=[0, 7]),
            "row 1: allowed_token_ids names token 7, beyond the vocabulary of 3 tokens",
        ),
        (
            SamplingParams(bad_words_token_ids=[[1], [4]]),
            "row 1: bad_words names token 4, beyond the vocabulary of 3 tokens",
        ),
    ],
    ids=["allowed_token_ids", "bad_words"],
)
def test_a_token_beyond_the_vocabulary_is_refused_by_name(
    params: SamplingParams, message: str
) -> None:
    logits = _logits([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    out = outcome(
        lambda: apply_logits_processors(logits, [SamplingParams(), params], [None] * 2).tolist()
    )
    assert out == ("ValueError", message)
    assert logits.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
