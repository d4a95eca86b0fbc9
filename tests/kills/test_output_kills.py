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
    detok = IncrementalDetokenizer(skip_special_tokens=skip)
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
    detok = IncrementalDetokenizer(skip_special_tokens=False)
    assert detok.add(ByteTokenizer(), [3]) == "a"
    assert detok.add(ByteTokenizer(), [5]) == "c"
    assert detok.text == "ac" and detok.num_tokens == 2


def test_a_long_completion_keeps_its_text_through_window_trims() -> None:
    steps = [[3], [4]] * 40
    out = detokenize(steps, skip=False)
    assert "".join(out) == "a " * 40 and out == ["a", " "] * 40


# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# More of the incremental detokeniser (engine/detokenizer.py), against a second byte
# tokenizer: kills xǁIncrementalDetokenizerǁadd__mutmut_29 and x__common_prefix__mutmut_3
# (the best-effort path, which the first tokenizer never reached: its context never
# changed earlier text), flush__mutmut_8, 16 and 22 (flushing a held-back character), and
# _drop_incomplete_context__mutmut_5 (a prompt ending in a lead byte and a special token).
# Expected texts by hand, from the module docstring's rules.
# --------------------------------------------------------------------------------------------

MORE_BYTES = {
    0: b"<s>",
    1: b"\xc3",
    2: b"\xa9",
    3: b"a",
    4: b" ",
    6: b"x",
    8: b"<s\xc3",
    9: b"x\xc3",
    10: b"\xc3\xa9a",
    11: b"",
    12: b"<s>!",
    13: b"\xc3\xa9\xc3\xa9a",
}


class ContextTokenizer:
    """Token i is MORE_BYTES[i]; 0 is special (12 is not: it only spells "<s>!"); an "a"
    right before an "x" reads "A", and 11 erases the byte before it: a token that changes
    text already emitted."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        raw = b""
        for t in token_ids:
            if not (skip_special_tokens and t == 0):
                raw = raw[:-1] if t == 11 else raw + MORE_BYTES[t]
        return raw.decode("utf-8", errors="replace").replace("ax", "Ax")


def _steps(prompt: list[int], steps: list[list[int]], skip: bool) -> tuple[list[Any], Any]:
    """Each step's added text and then the flush (or the exception's type), and the text."""
    detok = IncrementalDetokenizer(skip_special_tokens=skip)
    out: list[Any] = []
    try:
        out += [detok.add(ContextTokenizer(), step) for step in steps]
        out.append(detok.flush(ContextTokenizer()))
    except Exception as e:
        out.append(type(e))
    return out, detok.text


def test_text_that_an_earlier_token_changes_is_emitted_from_the_common_prefix() -> None:
    # Window "a" then "Ax": no common prefix, so all of "Ax" is new (best effort).
    assert _steps([4], [[3], [6]], skip=False) == (["a", "Ax", ""], "aAx")


def test_a_change_after_a_common_prefix_emits_only_what_follows_it() -> None:
    # Window "éa" then "éAx": they share "é" (one character), so "Ax" is new.
    assert _steps([4], [[10], [6]], skip=False) == (["éa", "Ax", ""], "éaAx")


def test_a_longer_common_prefix_is_not_emitted_again() -> None:
    # Window "ééa" then "ééAx": two characters shared (x__common_prefix__mutmut_12, 13).
    assert _steps([4], [[13], [6]], skip=False) == (["ééa", "Ax", ""], "ééaAx")


def test_the_first_token_is_decoded_as_the_start_of_the_completion() -> None:
    # Whatever the prompt ends with, the first token reads as one decode of the completion
    # does: "x", where after the prompt's "a" it would read "Ax" (the prompt was once the
    # first window's context, and streamed text then differed from generate's).
    assert _steps([3], [[6]], skip=False) == (["x", ""], "x")
    assert _steps([4, 4, 4, 4, 4, 4, 4, 3], [[6]], skip=False) == (["x", ""], "x")
    assert ContextTokenizer().decode([6]) == "x"


def test_trimming_the_window_keeps_the_last_emitted_tokens() -> None:
    # A long completion (lead bytes held back, windows trimmed past 4 x _CONTEXT tokens):
    # its last "a", then "x", still read "a", then "Ax" (add__mutmut_40 trimmed the
    # window itself away). The token list was found by a random search against it.
    tokens = [9, 1, 4, 3, 3, 6, 9, 2, 3, 4, 2, 9, 1, 2, 3, 9, 4, 4, 2, 9, 3, 4, 4, 4, 3, 6]
    steps, _ = _steps([4], [[t] for t in tokens], skip=False)
    assert steps[-3:] == ["a", "Ax", ""]


def test_a_token_that_shortens_the_window_adds_nothing() -> None:
    # Window "a" then "": nothing in common, nothing new (the shorter text runs out first).
    assert _steps([4], [[3], [11]], skip=False) == (["a", "", ""], "a")


def test_the_emitted_window_is_decoded_without_its_skipped_special_token() -> None:
    # Skipped, the window [<s>] reads "", so all of "<s>!" is new; read with the special
    # token, it would seem to hold its first three characters already.
    assert _steps([3], [[0], [12]], skip=True) == (["", "<s>!", ""], "<s>!")


def test_flush_emits_the_held_back_character_after_the_text() -> None:
    assert _steps([3], [[3], [1]], skip=False) == (["a", "", "\ufffd"], "a\ufffd")
    # Held back, "x" and a lead byte also change the emitted "a": the flush's best effort.
    assert _steps([4], [[3], [9]], skip=False) == (["a", "", "Ax\ufffd"], "aAx\ufffd")
    # A special token held back behind the incomplete character is skipped in the flush
    # as in every step (flush__mutmut_3 decoded it).
    assert _steps([3], [[3], [1], [0]], skip=True) == (["a", "", "", "\ufffd"], "a\ufffd")


def test_flush_decodes_the_window_without_its_skipped_special_token() -> None:
    # Window [<s>, "<s" + lead byte]: skipped, the emitted part reads "", so all of
    # "<s\ufffd" is new; read with the special token, it would seem to share "<s".
    assert _steps([3], [[0], [8]], skip=True) == (["", "", "<s\ufffd"], "<s\ufffd")


def test_a_prompt_ending_in_a_lead_byte_then_a_special_token_is_no_context() -> None:
    # Skipping the special token, the prompt's tail ends inside a character: dropped, so
    # the continuation byte alone is an incomplete character, as in the whole completion.
    assert _steps([1, 0], [[2]], skip=True) == (["", "\ufffd"], "\ufffd")


# --------------------------------------------------------------------------------------------
# OutputProcessor.store_logprobs refuses a result count that is not the batch's: kills
# xǁOutputProcessorǁabsorb__mutmut_2 (no message; ``absorb`` was its name then). Its check
# is what makes every later zip over the step's sequences and tokens equal-length (see
# tests/equivalent_mutants.md).
# --------------------------------------------------------------------------------------------


def test_store_logprobs_refuses_a_result_count_that_is_not_the_batchs() -> None:
    from tests.engine_machine import build_engine
    from tests.kills.test_llm_engine_kills import CONFIG

    engine = build_engine(CONFIG, spec=False)
    try:
        engine.output_processor.store_logprobs([], [5])
    except RuntimeError as e:
        assert str(e) == "the model runner returned 1 results for 0"
    else:
        raise AssertionError("store_logprobs took one result for no sequence")
