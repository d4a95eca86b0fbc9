"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/sequence.py: the
refusals' exact messages (the selection matched them loosely or not at all), a fresh
sequence's counters, and ``from_checked_tokens``' fields.

Each section names what it kills; the expected values are written out by hand. A refusal
is compared as (exception type, message), so that a mutant that accepts, or raises
something else, fails a comparison instead of crashing the test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1


def _refusal(build: Callable[[], Any]) -> tuple[str, str] | str:
    """(type name, message) of what ``build`` raises, or "accepted"."""
    try:
        build()
    except Exception as exc:  # compared by the caller, not swallowed
        return type(exc).__name__, str(exc)
    return "accepted"


# --------------------------------------------------------------------------------------------
# block_size: kills __init____mutmut_2 (`... or (bool and < 1)`: 0 accepted), _3 (`(not
# int and bool) or < 1`: "4" compared with 1, 2.0 accepted) and _7 (message None).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [0, -3, True, "4", 2.0], ids=repr)
def test_a_bad_block_size_is_refused_by_name(bs: Any) -> None:
    assert _refusal(lambda: Sequence([1], block_size=bs)) == (
        "ValueError",
        f"block_size must be an int >= 1, got {bs!r}",
    )


# --------------------------------------------------------------------------------------------
# Tokens: kills _12 (the empty message), _20 to _24 (the non-int named: None, next(None),
# the first token, the first int, message None), _30 (`>= INT64_MAX`: the largest id
# refused, by a StopIteration), _31 and _33 to _36 (the out-of-range token named: None,
# the first in range, 0 counted out of range, INT64_MAX counted out of range).
# --------------------------------------------------------------------------------------------


def test_an_empty_prompt_is_refused_by_name() -> None:
    assert _refusal(lambda: Sequence([])) == ("ValueError", "a sequence needs at least one token")


@pytest.mark.parametrize(
    ("tokens", "bad"), [([1, 2.0, 3], "2.0"), ([4, 5, True], "True"), ([None], "None")]
)
def test_a_token_that_is_not_an_int_is_named(tokens: list[Any], bad: str) -> None:
    assert _refusal(lambda: Sequence(tokens)) == ("TypeError", f"token ids must be ints, got {bad}")


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [([5, -1], -1), ([0, -2], -2), ([INT64_MAX, 2**63], 2**63), ([3, 2**64, -4], 2**64)],
)
def test_a_token_out_of_range_is_named(tokens: list[int], bad: int) -> None:
    assert _refusal(lambda: Sequence(tokens)) == (
        "ValueError",
        f"token ids must be in [0, 2**63), got {bad}",
    )


def test_the_extreme_token_ids_are_accepted() -> None:
    assert _refusal(lambda: Sequence([0, INT64_MAX])) == "accepted"
    assert Sequence([0, INT64_MAX]).token_ids == [0, INT64_MAX]


def test_an_empty_cache_salt_is_refused_by_name() -> None:
    assert _refusal(lambda: Sequence([1], cache_salt="")) == (
        "ValueError",
        "cache_salt must be a non-empty string",
    )


# --------------------------------------------------------------------------------------------
# A fresh sequence: kills _set_fields__mutmut_1, _2, _3, _5 (seq_id None, the given one
# dropped or preferred wrongly), _8 (last_token None), _13 to _19 (num_cached_tokens,
# num_scheduled_tokens, num_prefix_hit_tokens and is_prefill started otherwise).
# --------------------------------------------------------------------------------------------


def test_sequences_number_themselves_unless_given_an_id() -> None:
    a, b = Sequence([1]), Sequence([2])
    assert type(a.seq_id) is int and type(b.seq_id) is int
    assert b.seq_id != a.seq_id
    assert Sequence([3], seq_id=7).seq_id == 7


def _fresh_fields(seq: Sequence) -> tuple[Any, ...]:
    return (
        seq.last_token,
        seq.num_cached_tokens,
        seq.num_scheduled_tokens,
        seq.num_prefix_hit_tokens,
        seq.is_prefill,
    )


def test_a_fresh_sequence_starts_at_zero_in_prefill() -> None:
    fields = _fresh_fields(Sequence([4, 5, 6]))
    assert fields == (6, 0, 0, None, True)
    assert [type(f) for f in fields] == [int, int, int, type(None), bool]


# --------------------------------------------------------------------------------------------
# from_checked_tokens keeps its block size and salt: kills from_checked_tokens__mutmut_5
# (block_size None) and _6 (cache_salt None).
# --------------------------------------------------------------------------------------------


def test_from_checked_tokens_keeps_the_block_size_and_salt() -> None:
    seq = Sequence.from_checked_tokens(
        [1, 2, 3, 4, 5], SamplingParams(), block_size=2, cache_salt="s"
    )
    assert (seq.block_size, seq.cache_salt) == (2, "s")
    assert seq.num_blocks == 3
    assert _fresh_fields(seq) == (5, 0, 0, None, True)
