"""Tests that kill mutants mutmut (tox -e mutation) found alive: the logit processors and
the sampling filters (layers/logits_processors.py, layers/sampler.py).

Each section names what it kills. The expected values never come from the code under test:
they are computed by a second, deliberately naive procedure or written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from paged_engine.layers.logits_processors import apply_logits_processors
from paged_engine.layers.sampler import Sampler, probabilities
from paged_engine.sampling_params import SamplingParams
from tests.sampling_draws import draw_rows

# --------------------------------------------------------------------------------------------
# Logit processors (layers/logits_processors.py). The selection compared whole generations
# with transformers, where the penalties were never exactly 2.0 (repetition) or 1.0
# (presence), no row lacked a history beside one that had it, no history or stop id reached
# the vocabulary's end, and no bias met a non-zero logit. Expected values by hand.
# --------------------------------------------------------------------------------------------


class History:
    """A token history: the prompt, then the output."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids = [*prompt, *output]
        self.num_prompt_tokens = len(prompt)


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_a_repetition_penalty_of_exactly_two_applies() -> None:
    out = apply_logits_processors(
        _logits([4.0, -4.0, 1.0]), [SamplingParams(repetition_penalty=2.0)], [History([0, 1], [])]
    )
    assert out.tolist() == [[2.0, -8.0, 1.0]]


def test_a_presence_penalty_of_exactly_one_applies() -> None:
    out = apply_logits_processors(
        _logits([4.0, 4.0, 4.0]), [SamplingParams(presence_penalty=1.0)], [History([0], [2, 2])]
    )
    assert out.tolist() == [[4.0, 4.0, 3.0]]  # the prompt's token 0 is not an output token


def test_penalised_rows_beside_a_row_without_history() -> None:
    # Row 0 only biases (it needs no history); row 1 is penalised.
    params = [
        SamplingParams(logit_bias={1: 0.5}),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
    ]
    out = apply_logits_processors(_logits([1.0, 1.0], [1.0, 1.0]), params, [None, History([], [1])])
    assert out.tolist() == [[1.0, 1.5], [1.0, -0.5]]  # row 1: 1 / 2 - 1 x 1


def test_a_bias_adds_to_the_logit() -> None:
    out = apply_logits_processors(
        _logits([3.0, -1.0]), [SamplingParams(logit_bias={0: 2.0, 1: -0.5})], [None]
    )
    assert out.tolist() == [[5.0, -1.5]]


def test_history_ids_at_the_vocabulary_end_are_ignored() -> None:
    # Token 3 does not exist in a 3-token vocabulary: counted as row 0's token 3 it would
    # land on row 1's token 0.
    params = [SamplingParams(repetition_penalty=2.0)] * 2
    out = apply_logits_processors(
        _logits([2.0, 2.0, 2.0], [2.0, 2.0, 2.0]), params, [History([3], []), History([1], [])]
    )
    assert out.tolist() == [[2.0, 2.0, 2.0], [2.0, 1.0, 2.0]]


def test_min_tokens_ignores_stop_ids_beyond_the_vocabulary() -> None:
    params = [SamplingParams(min_tokens=2, stop_token_ids=[1, 3])]
    out = apply_logits_processors(_logits([1.0, 1.0, 1.0]), params, [History([0], [])], (2,))
    assert out.tolist() == [[1.0, float("-inf"), float("-inf")]]


@pytest.mark.parametrize(
    ("params", "histories", "message"),
    [
        ([SamplingParams()], [None, None], "2 logit rows but 1 params and 2 histories"),
        ([SamplingParams()] * 2, [None], "2 logit rows but 2 params and 1 histories"),
        (
            [SamplingParams(), SamplingParams(min_tokens=1)],
            [None, None],
            "row 1 uses penalties, min_tokens or bad_words but has no token history",
        ),
        (
            [SamplingParams(logit_bias={5: 1.5})] * 2,
            [None, None],
            "row 0: logit_bias names token 5, beyond the vocabulary of 2 tokens",
        ),
    ],
    ids=["params", "histories", "min_tokens", "bias"],
)
def test_refused_rows_name_the_problem_and_leave_logits_alone(
    params: list[SamplingParams], histories: list[History | None], message: str
) -> None:
    logits = _logits([1.0, 2.0], [3.0, 4.0])
    with pytest.raises(ValueError) as info:
        apply_logits_processors(logits, params, histories)
    assert str(info.value) == message
    assert logits.tolist() == [[1.0, 2.0], [3.0, 4.0]]


# --------------------------------------------------------------------------------------------
# Filtered sampling probabilities (layers/sampler.py): min_p must add to top-k's cut, not
# replace it; among equal logits the lower token id ranks first.
# --------------------------------------------------------------------------------------------


def test_min_p_does_not_undo_top_k() -> None:
    # min_p = 0.01 keeps all three tokens; top_k = 1 keeps only the most likely.
    probs = probabilities(_logits([2.0, 1.0, 0.0]), [SamplingParams(top_k=1, min_p=0.01)])
    assert probs.tolist() == [[1.0, 0.0, 0.0]]


def test_top_k_among_equal_logits_keeps_the_lowest_ids() -> None:
    probs = probabilities(_logits([1.0] * 6), [SamplingParams(top_k=2)])
    assert probs.tolist() == [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]]


def test_top_p_drops_a_token_whose_preceding_mass_equals_it_exactly() -> None:
    # The float32 mass before token 1 of the row [0, -1, -2] (already sorted, maximum 0),
    # computed with torch's own softmax and cumsum: top_p set to exactly that value.
    shifted = _logits([0.0, -1.0, -2.0])
    p = torch.softmax(shifted, dim=-1)
    top = float((p.cumsum(dim=-1) - p)[0, 1])
    probs = probabilities(shifted + 2.0, [SamplingParams(top_p=top)])
    # The nucleus is complete before token 1: only token 0 may be drawn.
    assert probs[0, 0] > 0 and probs[0, 1:].tolist() == [0.0, 0.0]


def test_top_p_of_one_drops_nothing_even_where_float32_mass_reaches_one() -> None:
    # exp(-30) is below float32's resolution at 1.0: the mass before token 1 rounds to
    # exactly 1.0. top_k = 2 routes the row through the filter; top_p = 1.0 must not cut.
    probs = probabilities(_logits([0.0, -30.0, -31.0]), [SamplingParams(top_k=2, top_p=1.0)])
    assert probs[0, 1] > 0 and probs[0, 2] == 0


def test_top_p_and_penalties_validation_that_the_filters_rely_on() -> None:
    # top_p in (0, 1]: the most likely token (preceding mass 0) can never be dropped.
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    # A penalised row needs its history: rows without one never reach the penalties.
    with pytest.raises(ValueError, match="row 0 uses penalties"):
        apply_logits_processors(_logits([1.0]), [SamplingParams(repetition_penalty=1.5)], [None])


# --------------------------------------------------------------------------------------------
# The sampler's index tensors follow the logits, not torch's default device (a caller may
# have set one, e.g. torch.set_default_device): kills sampler.x_probabilities__mutmut_27 and
# xǁSamplerǁ__call____mutmut_65 (``device=`` dropped: a meta-device index into CPU logits).
# --------------------------------------------------------------------------------------------


def test_sampling_ignores_torchs_default_device() -> None:
    logits = _logits([0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 5.0, 1.0])
    unfiltered = torch.softmax(logits[2] - 5.0, dim=-1)  # row 2 at temperature 1, by hand
    greedy, top1 = SamplingParams(temperature=0.0), SamplingParams(top_k=1)
    with torch.device("meta"):
        probs = probabilities(logits[1:], [top1, SamplingParams()])  # one row of each group
        tokens = Sampler()(logits, [greedy, top1, top1], [None, None, None])
    assert probs.device.type == "cpu"
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # top_k=1 keeps the largest logit only
    assert torch.equal(probs[1], unfiltered)
    assert tokens == [3, 0, 2]  # argmax, and the only token top_k=1 leaves in each row


# --------------------------------------------------------------------------------------------
# A row that filters nothing is a plain softmax, bit for bit: kills
# sampler.x__needs_filter__mutmut_7 (top_p < 2.0: every row takes the sorted filtering path,
# whose softmax over the sorted row rounds differently).
# --------------------------------------------------------------------------------------------


def test_an_unfiltered_row_is_exactly_the_softmax_of_its_scaled_logits() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / 0.7, dim=-1)
    got = probabilities(logits, [SamplingParams(temperature=0.7)] * 4)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------
# The sampler refuses a generator list of another length (histories matching): kills
# sampler.xǁSamplerǁ__call____mutmut_8 (``and`` let it through).
# --------------------------------------------------------------------------------------------


def test_a_generator_list_of_another_length_is_refused_by_name() -> None:
    logits = _logits([1.0, 2.0], [3.0, 4.0])
    with pytest.raises(ValueError) as info:
        Sampler()(logits, [SamplingParams()] * 2, [None], [None, None])
    assert str(info.value) == "2 logit rows but 2 params, 1 generators and 2 histories"
    assert logits.tolist() == [[1.0, 2.0], [3.0, 4.0]]


# --------------------------------------------------------------------------------------------
# Torch's default device reaches neither the random draw nor logit_bias. Written against
# a ``Sampler._sample`` that has since moved to tests/sampling_draws.py (it killed its
# mutant that put the picked tokens on the default device; ``_draws`` now builds them on
# the probabilities' device); it still kills
# logits_processors.x_apply_logits_processors__mutmut_83, _85 (the bias ids on it) and _90
# (the bias values). A meta default device makes the mutants raise: the outcome is compared.
# --------------------------------------------------------------------------------------------


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as exc:  # compared by the caller, not swallowed
        return type(exc).__name__


def test_random_draws_and_logit_bias_ignore_torchs_default_device() -> None:
    one_hot = _logits([-1000.0, 0.0, -1000.0])  # softmax: exactly [0, 1, 0]
    ones = _logits([1.0, 1.0, 1.0])
    biased = SamplingParams(logit_bias={0: 0.5, 2: 2.0})
    with torch.device("meta"):
        drawn = _outcome(lambda: draw_rows(one_hot, [SamplingParams()], [None]).tolist())
        bias = _outcome(lambda: apply_logits_processors(ones, [biased], [None]).tolist())
    assert drawn == [1]
    assert bias == [[1.5, 1.0, 3.0]]


# --------------------------------------------------------------------------------------------
# Unseeded rows draw the same tokens whether or not seeded rows share their batch (the
# seeded ones use their own generators). Written against an older ``Sampler._sample``
# (its mutant ``sel = None`` drew the unseeded rows' noise over every row); it now checks
# ``_draws``' grouping by generator.
# --------------------------------------------------------------------------------------------


def test_seeded_rows_do_not_change_the_unseeded_rows_draws() -> None:
    logits = torch.zeros(5, 64)  # uniform: any change of noise changes the argmax
    params = [SamplingParams()] * 5
    with torch.random.fork_rng():
        torch.manual_seed(0)
        mixed = draw_rows(logits, params, [torch.Generator().manual_seed(1)] + [None] * 4)
        torch.manual_seed(0)
        alone = draw_rows(logits[1:], params[1:], [None] * 4)
    assert mixed[1:].tolist() == alone.tolist()


# --------------------------------------------------------------------------------------------
# top_k among tied logits keeps the lowest ids (a stable sort): kills
# sampler.x__filtered_probs__mutmut_32 (stable=False, which reorders ties on the CPU
# from about 100 columns on).
# --------------------------------------------------------------------------------------------


def test_top_k_among_ties_keeps_the_lowest_ids() -> None:
    probs = probabilities(torch.zeros(2, 500), [SamplingParams(top_k=5)] * 2)
    assert [row.nonzero().flatten().tolist() for row in probs] == [[0, 1, 2, 3, 4]] * 2
