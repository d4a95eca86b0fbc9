"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/request_limits.py
(the logprobs bound, the stop-string and bad_words refusals, bad_words' tokenization) and
engine/detokenizer.py (the Python rule's first chunk and flush, the DecodeStream path's
special tokens, and which tokenizers ``stream_backend`` streams through).

Each section names what it kills (names under ``paged_engine.engine.``). The expected
values are written out by hand from the docstrings and the messages' documented wording.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.detokenizer import (
    IncrementalDetokenizer,
    make_detokenizer,
    stream_backend,
)
from paged_engine.engine.inputs import check_request
from paged_engine.engine.request_limits import logprobs_bound, tokenize_bad_words
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams
from tests.outcomes import outcome

TOKENS = [1, 2, 3]
INT64_MAX = 9223372036854775807  # 2**63 - 1, written out


def _config(max_logprobs: int) -> EngineConfig:
    return EngineConfig(
        max_model_len=40, num_kvcache_blocks=20, kvcache_block_size=4, max_logprobs=max_logprobs
    )


def _check(params: SamplingParams, max_logprobs: int = 20, vocab_size: int | None = None) -> object:
    """check_request's outcome: "ok", or the refusal's type and message (no ``where``)."""

    def run() -> str:
        check_request(
            TOKENS,
            params,
            _config(max_logprobs),
            20,
            "",
            has_tokenizer=False,
            vocab_size=vocab_size,
        )
        return "ok"

    return outcome(run)


def _refused(field: str, k: int, most: int, bound: str) -> tuple[str, str]:
    return ("InvalidRequestError", f"{field}={k} is more than the {most} allowed ({bound})")


# --------------------------------------------------------------------------------------------
# logprobs_bound: max_logprobs=0 allows the sampled token's logprob only (0 is a bound, not
# "none"): kills request_limits.x_logprobs_bound__mutmut_4 (> 0) and _5 (>= 1), which make
# 0 unbounded.
# --------------------------------------------------------------------------------------------


def test_max_logprobs_zero_bounds_requests_to_zero_logprobs() -> None:
    assert logprobs_bound(0, None) == (0, "max_logprobs")
    assert logprobs_bound(0, 768) == (0, "max_logprobs")
    assert _check(SamplingParams(logprobs=0), max_logprobs=0) == "ok"
    assert _check(SamplingParams(logprobs=1), max_logprobs=0) == _refused(
        "logprobs", 1, 0, "max_logprobs"
    )
    assert _check(SamplingParams(prompt_logprobs=1), max_logprobs=0, vocab_size=768) == _refused(
        "prompt_logprobs", 1, 0, "max_logprobs"
    )


# --------------------------------------------------------------------------------------------
# max_logprobs=-1 (no bound of its own): without a vocabulary the bound is the largest int64
# and the message says "max_logprobs=-1"; with one, the vocabulary. Kills
# request_limits.x_logprobs_bound__mutmut_3 (-1 kept as the bound: every request refused),
# _14 (2**63 + 1), _15 (2 * 63 - 1 = 125), _16 (3**63 - 1), _17 (2**64 - 1), _18 (2**63 - 2),
# _19 and _20 (the bound's name changed in the message), and _8 (`limit is None and
# vocab_size < limit`: compares an int with None, and never lets the vocabulary bind).
# --------------------------------------------------------------------------------------------


def test_max_logprobs_minus_one_without_a_vocabulary_bounds_at_the_largest_int64() -> None:
    assert logprobs_bound(-1, None) == (INT64_MAX, "max_logprobs=-1")
    assert _check(SamplingParams(logprobs=0), max_logprobs=-1) == "ok"
    assert _check(SamplingParams(logprobs=126), max_logprobs=-1) == "ok"
    assert _check(SamplingParams(prompt_logprobs=INT64_MAX), max_logprobs=-1) == "ok"
    assert _check(SamplingParams(logprobs=INT64_MAX + 1), max_logprobs=-1) == (
        "InvalidRequestError",
        "logprobs=9223372036854775808 is more than the 9223372036854775807 allowed "
        "(max_logprobs=-1)",
    )


def test_max_logprobs_minus_one_with_a_vocabulary_is_bounded_by_the_vocabulary() -> None:
    assert outcome(lambda: logprobs_bound(-1, 768)) == (768, "the vocabulary size")
    assert _check(SamplingParams(logprobs=768), max_logprobs=-1, vocab_size=768) == "ok"
    assert _check(SamplingParams(logprobs=769), max_logprobs=-1, vocab_size=768) == _refused(
        "logprobs", 769, 768, "the vocabulary size"
    )


# --------------------------------------------------------------------------------------------
# max_logprobs against the vocabulary: the smaller binds, and max_logprobs is named when they
# are equal (the vocabulary only caps a max_logprobs beyond it). Kills
# request_limits.x_logprobs_bound__mutmut_8 (a smaller vocabulary ignored), _9 (`limit is
# not None or ...`: a larger vocabulary replaces max_logprobs) and _10 (`<=`: the vocabulary
# named on a tie).
# --------------------------------------------------------------------------------------------


def test_the_smaller_of_max_logprobs_and_the_vocabulary_bounds_logprobs() -> None:
    assert logprobs_bound(20, 5) == (5, "the vocabulary size")
    assert logprobs_bound(20, 768) == (20, "max_logprobs")
    assert logprobs_bound(20, 20) == (20, "max_logprobs")
    assert _check(SamplingParams(logprobs=6), vocab_size=5) == _refused(
        "logprobs", 6, 5, "the vocabulary size"
    )
    assert _check(SamplingParams(logprobs=20), vocab_size=768) == "ok"
    assert _check(SamplingParams(logprobs=21), vocab_size=768) == _refused(
        "logprobs", 21, 20, "max_logprobs"
    )
    assert _check(SamplingParams(logprobs=21), vocab_size=20) == _refused(
        "logprobs", 21, 20, "max_logprobs"
    )


# --------------------------------------------------------------------------------------------
# The refusals' exact messages: a stop string over 1,024 characters shows its first 40
# (kills request_limits.x_check_strings__mutmut_11, 41 shown); bad_words without a tokenizer
# (kills request_limits.x_with_bad_words__mutmut_25, the message changed).
# --------------------------------------------------------------------------------------------


def test_a_too_long_stop_string_is_refused_showing_its_first_40_characters() -> None:
    stop = ("abcdefghijklmnopqrstuvwxyz" * 40)[:1025]
    assert _check(SamplingParams(stop=[stop])) == (
        "InvalidRequestError",
        "stop holds a string of 1025 characters, more than the 1024 allowed: "
        "'abcdefghijklmnopqrstuvwxyzabcdefghijklmn'...",
    )


def test_bad_words_without_a_tokenizer_are_refused_saying_why() -> None:
    with pytest.raises(InvalidRequestError) as e:
        check_request(
            TOKENS, SamplingParams(bad_words=["x"]), _config(20), 20, "", has_tokenizer=False
        )
    assert (e.value.field, str(e.value)) == (
        "bad_words",
        "bad_words need a tokenizer: they are banned as tokens",
    )


# --------------------------------------------------------------------------------------------
# bad_words through an ``encode`` whose signature cannot be read (a C callable): it is called
# with the text alone, as it may take nothing else. Kills
# request_limits.x__plain_encoder__mutmut_7 (add_special_tokens=False passed all the same).
# --------------------------------------------------------------------------------------------


class _OpaqueEncode:
    """A callable ``inspect.signature`` cannot read, taking the text alone: its ids are the
    characters' code points."""

    __signature__ = "unreadable"

    def __call__(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class _OpaqueTokenizer:
    def __init__(self) -> None:
        self.encode = _OpaqueEncode()


def test_bad_words_are_tokenized_through_an_encode_without_a_readable_signature() -> None:
    words = outcome(lambda: tokenize_bad_words(["  ab"], _OpaqueTokenizer()))
    assert words == ((97, 98), (32, 97, 98))


# --------------------------------------------------------------------------------------------
# The Python rule over a decoder whose text for no tokens is not "" (here every text starts
# with ">"): the completion's text is still exactly one decode of its tokens, and a
# detokenizer that has seen no token emits nothing. Kills
# detokenizer.xǁIncrementalDetokenizerǁ_add_token__mutmut_9 and flush__mutmut_11 (decode([])
# taken as the text before the first token), and reset__mutmut_2 (`_emitted = None`: a fresh
# flush decodes the empty window).
# --------------------------------------------------------------------------------------------


BYTES = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"X\xc3"}


class _Bytes:
    """A byte-level decoder: the tokens' bytes, decoded as UTF-8 with U+FFFD for what is
    invalid or incomplete; ``prefix`` starts every text (even that of no tokens)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(BYTES[i] for i in ids)
        return self.prefix + data.decode("utf-8", errors="replace")


def test_the_first_token_text_is_one_decode_even_when_no_tokens_decode_to_text() -> None:
    tok = _Bytes(">")
    detok = IncrementalDetokenizer(skip_special_tokens=True)
    assert detok.add(tok, [1]) == ">a"
    assert detok.text == ">a"


def test_a_flushed_first_character_is_one_decode_even_when_no_tokens_decode_to_text() -> None:
    tok = _Bytes(">")
    detok = IncrementalDetokenizer(skip_special_tokens=True)
    assert detok.add(tok, [2]) == ""  # an incomplete character: held back
    assert detok.flush(tok) == ">\ufffd"
    assert detok.text == ">\ufffd"


def test_a_detokenizer_that_saw_no_token_flushes_nothing() -> None:
    tok = _Bytes(">")
    detok = IncrementalDetokenizer(skip_special_tokens=True)
    assert detok.flush(tok) == ""
    assert detok.text == ""


# --------------------------------------------------------------------------------------------
# A flush when nothing was emitted yet: the text before is "". Kills
# detokenizer.xǁIncrementalDetokenizerǁflush__mutmut_16 ("XXXX" before: a held-back text
# starting with "X" lost its "X").
# --------------------------------------------------------------------------------------------


def test_a_flush_of_a_completion_held_back_from_its_first_token_emits_its_whole_text() -> None:
    tok = _Bytes()
    detok = IncrementalDetokenizer(skip_special_tokens=True)
    assert detok.add(tok, [4]) == ""  # "X" then an incomplete character
    assert detok.flush(tok) == "X\ufffd"
    assert detok.text == "X\ufffd"


# --------------------------------------------------------------------------------------------
# IncrementalDetokenizer() skips special tokens unless told otherwise (SamplingParams'
# default): kills detokenizer.xǁIncrementalDetokenizerǁ__init____mutmut_1 (default False).
# --------------------------------------------------------------------------------------------


class _WithSpecial:
    """Token 0 is the special ``<s>``, token 1 is "a"."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "" if i == 0 and skip_special_tokens else "<s>" if i == 0 else "a" for i in ids
        )


def test_an_incremental_detokenizer_skips_special_tokens_by_default() -> None:
    detok = IncrementalDetokenizer()
    assert detok.add(_WithSpecial(), [0, 1]) == "a"
    assert detok.text == "a"


# --------------------------------------------------------------------------------------------
# Through DecodeStream with skip_special_tokens=False, the flush decodes with the special
# tokens kept: a byte-level tokenizer whose special token sits between the two bytes of an
# "é" gives two U+FFFD around "<s>". Kills detokenizer.xǁStreamingDetokenizerǁ_decode__mutmut_5
# (the backend's default, skip_special_tokens=True: the bytes join into "é").
# --------------------------------------------------------------------------------------------


def _byte_level() -> Any:
    """A tokenizers.Tokenizer: ids 0, 1, 2 are the byte-level characters of bytes 0xC3,
    0xA9 and "a"; id 3 is the special token ``<s>``."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"\u00c3": 0, "\u00a9": 1, "a": 2}, unk_token="a"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>"])
    return tok


def test_a_streamed_flush_keeps_special_tokens_when_they_are_not_skipped() -> None:
    tok = _byte_level()
    detok = make_detokenizer(stream_backend(tok), skip_special_tokens=False)
    assert detok.add(tok, [0, 3, 1]) == "\ufffd<s>"
    assert detok.flush(tok) == "\ufffd"
    assert detok.text == "\ufffd<s>\ufffd"


# --------------------------------------------------------------------------------------------
# stream_backend: None for what it cannot vouch for. Kills detokenizer.x_stream_backend__mutmut_9
# (`and`: a tokenizers without DecodeStream still streamed), _33 (no default for
# clean_up_tokenization_spaces: a wrapper without it raises), _48 and _53 (no default for
# the class's decode or its __module__: a class without decode raises).
# --------------------------------------------------------------------------------------------


def _word_level() -> Any:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))


def test_no_stream_backend_without_decode_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _word_level()
    monkeypatch.setitem(sys.modules, "tokenizers.decoders", types.ModuleType("tokenizers.decoders"))
    assert outcome(lambda: stream_backend(tok)) is None


class _Wrapper:
    """A tokenizer of its own over a ``tokenizers.Tokenizer``, saying nothing of clean-up."""

    def __init__(self) -> None:
        self._tokenizer = _word_level()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text


class _EncodeOnly:
    """An encode-only tokenizer over a ``tokenizers.Tokenizer``, without clean-up."""

    clean_up_tokenization_spaces = False

    def __init__(self) -> None:
        self._tokenizer = _word_level()

    def encode(self, text: str) -> list[int]:
        return [0 for _ in text.split()]


def test_no_stream_backend_for_a_tokenizer_it_cannot_vouch_for() -> None:
    assert outcome(lambda: stream_backend(_Wrapper())) is None
    assert outcome(lambda: stream_backend(_EncodeOnly())) is None
