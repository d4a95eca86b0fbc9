"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/inputs.py (a
random sample of its mutants was run: see scripts/mutation.py --sample).

Each section names what it kills; the expected values are written out by hand.
"""

from __future__ import annotations

from paged_engine.engine.inputs import parse_prompt


class TokenId(int):
    """An int subclass: not the plain ints the fast check passes, so each is checked."""


# --------------------------------------------------------------------------------------------
# Token 0 is in the vocabulary on the per-token path too: kills inputs.x__check_tokens__
# mutmut_23 (``0 < id``: token 0 refused once any token is not a plain int).
# --------------------------------------------------------------------------------------------


def test_token_zero_is_accepted_beside_an_int_subclass() -> None:
    parsed = parse_prompt([0, TokenId(3), 9], None, 10, "prompt")
    assert parsed.token_ids == [0, 3, 9]
    assert [type(t) for t in parsed.token_ids] == [int, int, int]


# --------------------------------------------------------------------------------------------
# The salt comes through, and no salt is None: kills inputs.x_parse_prompt__mutmut_2 (no
# salt read as "") and 62 (the salt dropped).
# --------------------------------------------------------------------------------------------


def test_a_prompts_salt_is_kept_and_no_salt_is_none() -> None:
    assert parse_prompt([1, 2], None, 10, "prompt").cache_salt is None
    assert parse_prompt({"prompt_token_ids": [1, 2]}, None, 10, "prompt").cache_salt is None
    salted = parse_prompt({"prompt_token_ids": [1, 2], "cache_salt": "tenant"}, None, 10, "p")
    assert (salted.token_ids, salted.text, salted.cache_salt) == ([1, 2], None, "tenant")
