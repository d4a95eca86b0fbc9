"""tests/logprobs_close.py's criterion on hand-made generations: each way it must fail."""

from __future__ import annotations

import pytest

from tests.logprobs_close import Generation, check_logprobs_close


def gen(tokens: list[int], tops: list[dict[int, float]]) -> Generation:
    return Generation(tokens, tops)


A = gen([1, 2, 3], [{1: -0.1, 9: -2.0}, {2: -0.2, 7: -1.9}, {3: -0.3, 8: -1.5}])


def test_identical_generations_agree() -> None:
    agreement = check_logprobs_close([A], [A], "a", "b", atol=0.01)
    assert (agreement.identical, agreement.diverged, agreement.max_logprob_diff) == (1, 0, 0.0)


def test_a_parting_within_each_others_top_k_is_accepted_and_ends_the_comparison() -> None:
    # Position 1: a chose 2, b chose 7; each is in the other's top-k with close logprobs.
    # After it, b's tokens and logprobs are wildly different: no longer compared.
    b = gen([1, 7, 5], [{1: -0.1, 9: -2.0}, {7: -0.25, 2: -0.26}, {5: -9.0}])
    a = gen([1, 2, 3], [{1: -0.1, 9: -2.0}, {2: -0.2, 7: -0.3}, {3: -0.3}])
    agreement = check_logprobs_close([a], [b], "a", "b", atol=0.1)
    assert (agreement.identical, agreement.diverged) == (0, 1)
    assert agreement.max_logprob_diff == pytest.approx(0.06)


def test_a_parting_outside_the_other_sides_top_k_fails() -> None:
    b = gen([1, 7, 3], [{1: -0.1, 9: -2.0}, {7: -0.2, 6: -0.3}, {3: -0.3}])
    with pytest.raises(AssertionError, match=r"position 1: .* not in b's top-k"):
        check_logprobs_close([A], [b], "a", "b", atol=1.0)


def test_far_apart_logprobs_fail_even_when_the_tokens_agree() -> None:
    b = gen([1, 2, 3], [{1: -0.1, 9: -2.0}, {2: -0.9, 7: -1.9}, {3: -0.3, 8: -1.5}])
    with pytest.raises(AssertionError, match=r"position 1: .* differ by 0\.7"):
        check_logprobs_close([A], [b], "a", "b", atol=0.5)


def test_different_lengths_or_counts_fail() -> None:
    short = gen([1, 2], A.top[:2])
    with pytest.raises(AssertionError, match="made 3 tokens, b 2"):
        check_logprobs_close([A], [short], "a", "b", atol=0.1)
    with pytest.raises(AssertionError, match="1 a outputs, 2 b"):
        check_logprobs_close([A], [A, A], "a", "b", atol=0.1)
