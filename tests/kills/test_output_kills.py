"""Tests that kill mutants mutmut (tox -e mutation) found alive: text and logprob output
(engine/detokenizer.py, engine/output_processor.py).

Each section names what it kills. The expected values never come from the code under test:
they are computed by a second, deliberately naive procedure or written out by hand.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from paged_engine import LLM
from paged_engine.engine.detokenizer import IncrementalDetokenizer, find_stop
from paged_engine.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# Stop strings (engine/detokenizer.py find_stop): the selection's tests never had two stop
# strings start at one index, a stop string twice among the new text, or one at index 0 of
# a one-token text. The oracle tries every (stop, start) pair.
# --------------------------------------------------------------------------------------------


def naive_find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """Every occurrence of every stop string that ends among the last ``new_chars``
    characters; the earliest start, then the longest."""
    old = len(text) - new_chars
    hits = [
        (i, -len(s), s)
        for s in stops
        for i in range(len(text) - len(s) + 1)
        if text[i : i + len(s)] == s and i + len(s) > old
    ]
    if not hits:
        return None
    i, _, s = min(hits)
    return s, i


@given(
    text=st.text(alphabet="ab", max_size=9),
    data=st.data(),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_find_stop_matches_trying_every_position(
    text: str, data: st.DataObject, stops: list[str]
) -> None:
    new_chars = data.draw(st.integers(0, len(text)), label="new_chars")
    assert find_stop(text, new_chars, stops) == naive_find_stop(text, new_chars, stops)


def test_find_stop_hand_written_cases() -> None:
    # At index 0, the whole text new.
    assert find_stop("ab", 2, ["ab"]) == ("ab", 0)
    # Ending at the first new character (spanning old and new text).
    assert find_stop("xxab", 1, ["ab"]) == ("ab", 2)
    assert find_stop("xxab", 1, ["xa"]) is None  # ends in old text: seen before
    # Twice among the new text: the first occurrence.
    assert find_stop("abab", 4, ["ab"]) == ("ab", 0)
    # Same start: the longer wins, in either order; an earlier start beats a longer one.
    assert find_stop("abc", 3, ["ab", "abc"]) == ("abc", 0)
    assert find_stop("abc", 3, ["abc", "ab"]) == ("abc", 0)
    assert find_stop("xabc", 4, ["abc", "xa"]) == ("xa", 0)
    assert find_stop("xabc", 4, ["xa", "abc"]) == ("xa", 0)


# --------------------------------------------------------------------------------------------
# Logprob dictionaries through the engine (engine/output_processor.py): the fake model returns
# no logprobs, and test_api_llm.py checks the sampled token's text only. Here, on the tiny
# Qwen3: every listed alternative's text, the sampled token's rank, prompt logprobs, and no
# text at all under detokenize=False.
# --------------------------------------------------------------------------------------------


def test_logprob_entries_are_complete(tiny_model_dir: Path) -> None:
    llm = LLM(model=tiny_model_dir, block_size=8, num_kvcache_blocks=64, max_model_len=128)
    tok = llm.get_tokenizer()
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for token, position in zip(c.token_ids, c.logprobs, strict=True):
        assert len(position) >= 2
        for t, lp in position.items():
            assert lp.decoded_token == tok.decode([t])
        sampled = position[token]
        more_likely = sum(lp.logprob > sampled.logprob for lp in position.values())
        assert isinstance(sampled.rank, int) and sampled.rank >= 1 + more_likely
    prompt = out.prompt_logprobs
    assert prompt is not None and len(prompt) == len(out.prompt_token_ids)
    assert prompt[0] is None  # nothing precedes the first prompt token
    for t0, position in zip(out.prompt_token_ids[1:], prompt[1:], strict=True):
        assert position is not None and t0 in position and len(position) >= 2
        assert all(lp.decoded_token == tok.decode([t]) for t, lp in position.items())

    raw_params = replace(params, detokenize=False)
    (raw,) = llm.generate({"prompt_token_ids": list(out.prompt_token_ids)}, raw_params)
    positions = [*(raw.outputs[0].logprobs or []), *(raw.prompt_logprobs or [])[1:]]
    assert len(positions) == 4 + len(out.prompt_token_ids) - 1
    assert all(lp.decoded_token is None for pos in positions if pos for lp in pos.values())


# --------------------------------------------------------------------------------------------
# Incremental detokenisation (engine/detokenizer.py) against a byte tokenizer: one character
# split over two tokens (U+FFFD until it completes), a special token, and a token whose
# text changes once the next token follows (the "best effort" path byte-level BPE never
# takes). Expected texts by hand.
# --------------------------------------------------------------------------------------------


TOKEN_BYTES = {0: b"<s>", 1: b"\xc3", 2: b"\xa9", 3: b"a", 4: b" ", 5: b"b"}


class ByteTokenizer:
    """Token i is TOKEN_BYTES[i]; token 0 is a special token; token 5 reads "b" alone but "c"
    after any other token (a tokenizer whose context changes earlier text)."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [t for t in token_ids if not (skip_special_tokens and t == 0)]
        text = b"".join(TOKEN_BYTES[t] for t in ids).decode("utf-8", errors="replace")
        if len(ids) > 1 and ids[-1] == 5:
            text = text[:-1] + "c"
        return text


def detokenize(steps: list[list[int]], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer([3], skip_special_tokens=skip)
    return [detok.add(ByteTokenizer(), step) for step in steps]


def test_a_split_character_comes_out_whole() -> None:
    assert detokenize([[1], [2], [3]], skip=False) == ["", "é", "a"]
    assert detokenize([[1, 2, 3]], skip=False) == ["éa"]  # within one call too


def test_special_tokens_follow_the_completions_setting() -> None:
    assert detokenize([[3], [0], [3]], skip=True) == ["a", "", "a"]
    assert detokenize([[3], [0], [3]], skip=False) == ["a", "<s>", "a"]


def test_text_that_changes_in_context_is_emitted_from_the_common_prefix() -> None:
    # Alone "b" would follow "a"; in context the window reads "ac": only what is new since
    # the common prefix is emitted, never a character twice.
    detok = IncrementalDetokenizer([4], skip_special_tokens=False)
    assert detok.add(ByteTokenizer(), [3]) == "a"
    assert detok.add(ByteTokenizer(), [5]) == "c"
    assert detok.text == "ac" and detok.num_tokens == 2


def test_a_long_completion_keeps_its_text_through_window_trims() -> None:
    steps = [[3], [4]] * 40
    out = detokenize(steps, skip=False)
    assert "".join(out) == "a " * 40 and out == ["a", " "] * 40


# --------------------------------------------------------------------------------------------
