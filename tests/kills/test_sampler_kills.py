"""Tests that kill mutants mutmut (tox -e mutation) found alive in the sampler
(layers/sampler.py) after tests/kills/test_sampling_kills.py.

Each section names what it kills. Expected values are written out by hand from the
documented behaviour (``SamplingParams``, ``Sampler`` and ``probabilities`` docstrings),
never computed by the code under test. The index-tensor mutants build a tensor on torch's
default device instead of the logits' one; under a meta default device the real code still
runs on the CPU, while a mutant's meta index reads uninitialised memory, writes nothing, or
raises: the outcome is compared either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paged_engine.layers.sampler import Sampler, probabilities
from paged_engine.sampling_params import SamplingParams
from tests.kills.test_sampling_kills import History


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as exc:  # compared by the caller, not swallowed
        return type(exc).__name__


# --------------------------------------------------------------------------------------------
# A row whose processing leaves every token at -inf gets None, and only that row: kills
# sampler.xǁSamplerǁ__call____mutmut_51 (``amax(dim=None)``: the maximum over the whole
# processed batch, so a finite neighbour made the dead row look alive).
# --------------------------------------------------------------------------------------------


def test_only_the_row_that_min_tokens_empties_gets_none() -> None:
    # Row 0: min_tokens masks eos 0 and stop id 1, the whole 2-token vocabulary. Row 1 is
    # processed too (a bias), and keeps finite logits: greedy picks the biased token 1.
    logits = torch.zeros(2, 2)
    params = [
        SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, logit_bias={1: 1.0}),
    ]
    tokens = Sampler()(logits, params, [None, None], [History([0], []), None], (0,))
    assert tokens == [None, 1]


# --------------------------------------------------------------------------------------------
# top_p is a float32 tensor, so a valid top_p below float32's smallest subnormal (1e-50 > 0
# passes validation) becomes 0: the most likely token must still be kept ("the most likely
# token is always kept"). Kills sampler.x__filtered_probs__mutmut_85 (``ranks >= 0``: the
# top token's preceding mass, 0, then reaches top_p and every token is dropped).
# --------------------------------------------------------------------------------------------


def test_a_top_p_that_underflows_float32_still_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tiny = SamplingParams(top_p=1e-50)
    probs = probabilities(logits, [tiny])
    assert probs[0].nonzero().flatten().tolist() == [1]
    # All-zero probabilities would draw token 0 (the argmax of 0 / noise).
    assert Sampler()(logits, [tiny], [None]) == [1]


# --------------------------------------------------------------------------------------------
# top_k equal to the vocabulary filters nothing, so the row is a plain softmax, bit for bit
# (as test_sampling_kills.py's unfiltered row): kills sampler.x__needs_filter__mutmut_5
# (``top_k <= vocab``: such rows take the sorted path, whose softmax rounds differently).
# --------------------------------------------------------------------------------------------


def test_top_k_of_the_whole_vocabulary_is_exactly_the_softmax() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / 0.7, dim=-1)
    got = probabilities(logits, [SamplingParams(temperature=0.7, top_k=1000)] * 4)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------
# min_p's thresholds follow the logits, not torch's default device: kills
# sampler.x__filtered_probs__mutmut_45, _47 (``device=None``, no ``device``: a meta tensor
# compared with CPU probabilities raises).
# --------------------------------------------------------------------------------------------


def test_min_p_ignores_torchs_default_device() -> None:
    # Token 2 is e**-3 ~ 0.05 times as likely as tokens 0 and 1, below min_p = 0.1: dropped,
    # and the two survivors share the mass equally.
    logits = torch.tensor([[0.0, 0.0, -3.0]])
    with torch.device("meta"):
        probs = _outcome(lambda: probabilities(logits, [SamplingParams(min_p=0.1)]).tolist())
    assert probs == [[0.5, 0.5, 0.0]]


# --------------------------------------------------------------------------------------------
# The processed rows' index tensors follow the logits, not torch's default device: kills
# sampler.xǁSamplerǁ__call____mutmut_33, _35 (the processed rows picked with a meta index:
# uninitialised logits, and their argmax written nowhere) and _77, _80, _82, _84, _86 (the
# copy of processed rows into the sampled ones with a meta index on either side: the draw
# sees the unbiased logits, or uninitialised ones). _33, _35 fail on row 0 whatever the
# memory holds (the greedy argmax is written nowhere); _84, _86 draw from uninitialised
# memory, which must hold exactly the three biased rows to pass (it never did in 26 runs).
# --------------------------------------------------------------------------------------------


def test_processed_rows_ignore_torchs_default_device() -> None:
    logits = torch.zeros(5, 50)
    logits[:, 0] = 1.0  # unprocessed, every row's argmax is token 0
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 5.0}),  # greedy, processed
        SamplingParams(top_k=1, logit_bias={17: 5.0}),  # drawn from its processed row
        SamplingParams(top_k=1, logit_bias={33: 5.0}),
        SamplingParams(top_k=1, logit_bias={49: 5.0}),
        SamplingParams(temperature=0.0),  # greedy, unprocessed
    ]
    with torch.device("meta"):
        tokens = _outcome(lambda: Sampler()(logits, params, [None] * 5))
    # top_k = 1 leaves only the biased token (logit 5 against 1 and 0) in each drawn row.
    assert tokens == [7, 17, 33, 49, 0]


# --------------------------------------------------------------------------------------------
# The drawn tokens are written back with an index on the logits' device: kills
# sampler.xǁSamplerǁ__call____mutmut_96, _98 (a meta index, which writes nothing, so each
# drawn row kept its argmax). A uniform draw over 1000 tokens with fixed seeds is token 0 in
# all four rows with probability 1e-12; the argmax of a uniform row is always token 0.
# --------------------------------------------------------------------------------------------


def test_drawn_tokens_reach_the_result_under_another_default_device() -> None:
    logits = torch.zeros(4, 1000)
    generators = [torch.Generator().manual_seed(seed) for seed in range(4)]
    with torch.device("meta"):
        tokens = _outcome(lambda: Sampler()(logits, [SamplingParams()] * 4, generators))
    assert isinstance(tokens, list) and len(tokens) == 4
    assert all(isinstance(t, int) and 0 <= t < 1000 for t in tokens)
    assert any(t != 0 for t in tokens)
