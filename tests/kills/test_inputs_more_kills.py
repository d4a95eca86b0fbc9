"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/inputs.py and
engine/request_builder.py: the exact refusals of a prompt (field, ``where``, message), the
logprobs bound the vocabulary sets, the message of too large a ``logit_bias``, and what
``RequestBuilder.build`` hands ``check_request`` (the vocabulary, the tokenizer) and each
completion's params.

Each section names what it kills; the expected values are written out by hand from the
docstrings (``InvalidRequestError``: the message is ``"{where}: {reason}"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_engine.engine.inputs import check_request, parse_params, parse_prompt
from paged_engine.engine.request_builder import RequestBuilder
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams
from tests.test_vocab_validation import CONFIG


def _refusal(run: Callable[[], object]) -> tuple[str, str, str, str] | tuple[str, str]:
    """What ``run`` raised: (type, field, where, message) for an ``InvalidRequestError``,
    (type, message) for anything else, ("returned", repr) when it raised nothing."""
    try:
        result = run()
    except InvalidRequestError as exc:
        return (type(exc).__name__, exc.field, exc.where, str(exc))
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return ("returned", repr(result))


class CharTokenizer:
    """Each character's code point as its token (a vocabulary of 128)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


# --------------------------------------------------------------------------------------------
# The refusals of a prompt, exactly: kills inputs.x__check_tokens__mutmut_8 (the empty
# prompt's message), inputs.x_parse_prompt__mutmut_104 (a dict with neither key),
# inputs.x_parse_prompt__mutmut_116 (a text prompt without a tokenizer) and
# inputs.x_parse_prompt__mutmut_40, _42, _45, _46, _47, _48 (an empty cache_salt: its field
# None or misspelled, its ``where`` dropped, its message changed).
# --------------------------------------------------------------------------------------------


def test_an_empty_prompt_is_refused_by_name() -> None:
    assert _refusal(lambda: parse_prompt([], None, 10, "prompt 3")) == (
        "InvalidRequestError",
        "prompt",
        "prompt 3",
        "prompt 3: the prompt is empty",
    )
    assert _refusal(lambda: parse_prompt({"prompt_token_ids": []}, None, 10, "add_request")) == (
        "InvalidRequestError",
        "prompt_token_ids",
        "add_request",
        "add_request: the prompt is empty",
    )


def test_a_prompt_dict_with_neither_key_is_refused_by_name() -> None:
    assert _refusal(lambda: parse_prompt({"cache_salt": "s"}, None, 10, "prompt 1")) == (
        "InvalidRequestTypeError",
        "prompt",
        "prompt 1",
        "prompt 1: a prompt dict needs 'prompt' or 'prompt_token_ids'",
    )


def test_a_text_prompt_without_a_tokenizer_is_refused_by_name() -> None:
    assert _refusal(lambda: parse_prompt("hello", None, 10, "prompt 0")) == (
        "InvalidRequestTypeError",
        "prompt",
        "prompt 0",
        "prompt 0: a text prompt needs a tokenizer; pass token ids",
    )
    assert _refusal(lambda: parse_prompt({"prompt": "hello"}, None, 10, "add_request")) == (
        "InvalidRequestTypeError",
        "prompt",
        "add_request",
        "add_request: a text prompt needs a tokenizer; pass token ids",
    )


def test_an_empty_cache_salt_is_refused_naming_the_salt_and_the_request() -> None:
    prompt = {"prompt_token_ids": [1, 2], "cache_salt": ""}
    assert _refusal(lambda: parse_prompt(prompt, None, 10, "prompt 2")) == (
        "InvalidRequestError",
        "cache_salt",
        "prompt 2",
        "prompt 2: cache_salt must be a non-empty string",
    )


# --------------------------------------------------------------------------------------------
# logprobs are bounded by the vocabulary when it is smaller than max_logprobs: kills
# inputs.x_check_request__mutmut_54 (``logprobs_bound(max_logprobs, None)``: the vocabulary
# forgotten, so 15 of a 10-token vocabulary passes under max_logprobs=20).
# --------------------------------------------------------------------------------------------


def test_logprobs_beyond_a_small_vocabulary_are_refused() -> None:
    for name in ("logprobs", "prompt_logprobs"):
        params = SamplingParams.from_dict({name: 15})

        def run(params: SamplingParams = params) -> object:
            return check_request(
                [1, 2], params, CONFIG, 16, "prompt 0", has_tokenizer=False, vocab_size=10
            )

        assert _refusal(run) == (
            "InvalidRequestError",
            name,
            "prompt 0",
            f"prompt 0: {name}=15 is more than the 10 allowed (the vocabulary size)",
        )


# --------------------------------------------------------------------------------------------
# Too large a logit_bias, the whole message: kills inputs.x_check_request__mutmut_115, _116
# (its closing hint "(allowed_token_ids takes any number)" changed).
# --------------------------------------------------------------------------------------------


def test_a_logit_bias_over_the_bound_is_refused_with_the_hint() -> None:
    params = SamplingParams.from_dict({"logit_bias": {t: 0.5 for t in range(1025)}})
    run = lambda: check_request(  # noqa: E731
        [1, 2], params, CONFIG, 16, "add_request", has_tokenizer=False, vocab_size=2000
    )
    assert _refusal(run) == (
        "InvalidRequestError",
        "logit_bias",
        "add_request",
        "add_request: logit_bias has 1025 entries, more than the 1024 allowed "
        "(allowed_token_ids takes any number)",
    )


# --------------------------------------------------------------------------------------------
# RequestBuilder.build checks every token id against the model's vocabulary: kills
# request_builder.xǁRequestBuilderǁbuild__mutmut_24 (``vocab_size=None``) and _32 (the
# argument dropped: its default None), under which check_request skips the vocabulary.
# --------------------------------------------------------------------------------------------


def test_the_builder_refuses_a_logit_bias_token_outside_the_vocabulary() -> None:
    builder = RequestBuilder(CONFIG, 16, 10, None)
    params = {"logit_bias": {10: 1.0}}
    run = lambda: builder.build("r", [1, 2], params, "add_request", stream=False)  # noqa: E731
    assert _refusal(run) == (
        "InvalidRequestError",
        "logit_bias",
        "add_request",
        "add_request: logit_bias names token 10, outside the vocabulary [0, 10)",
    )


# --------------------------------------------------------------------------------------------
# RequestBuilder.build tokenizes bad_words with the engine's tokenizer: kills
# request_builder.xǁRequestBuilderǁbuild__mutmut_25 (``tokenizer=None``) and _33 (the
# argument dropped: its default None), under which bad_words are refused as needing one.
# --------------------------------------------------------------------------------------------


def test_the_builder_tokenizes_bad_words_with_its_tokenizer() -> None:
    builder = RequestBuilder(CONFIG, 16, 128, CharTokenizer())

    def run() -> object:
        request = builder.build("r", [1, 2], {"bad_words": ["ab"]}, "add_request", stream=False)
        return request.params.bad_words_token_ids

    # vLLM's rule: the word as it is and after one space ("ab", " ab").
    assert _refusal(run) == ("returned", repr(((97, 98), (32, 97, 98))))


# --------------------------------------------------------------------------------------------
# Completions after the first keep the request's params, without prompt_logprobs: kills
# request_builder.xǁRequestBuilderǁbuild__mutmut_65 (``child = None``: the sequence falls
# back to default SamplingParams, temperature 1.0 and max_tokens 16).
# --------------------------------------------------------------------------------------------


def test_every_completion_samples_with_the_requests_params() -> None:
    builder = RequestBuilder(CONFIG, 16, 10, None)
    params = SamplingParams(n=2, temperature=0.5, max_tokens=5, prompt_logprobs=1)

    def run() -> object:
        request = builder.build("r", [1, 2, 3], params, "add_request", stream=False)
        return [
            (
                c.seq.sampling_params.temperature,
                c.seq.sampling_params.max_tokens,
                c.seq.sampling_params.prompt_logprobs,
            )
            for c in request.completions
        ]

    # vLLM returns prompt logprobs once per request: completion 0 alone asks for them.
    assert _refusal(run) == ("returned", repr([(0.5, 5, 1), (0.5, 5, None)]))


# --------------------------------------------------------------------------------------------
# Without a ``where`` (one request: ``InvalidRequestError``'s ""), parse_params lets the
# params' own refusal through as it is, unchained: kills
# inputs.x_parse_params__mutmut_3 (``where or not e.where``: a copy raised inside the
# handler, so chained to the original through ``__context__``).
# --------------------------------------------------------------------------------------------


def test_a_refusal_without_a_where_is_the_params_own_unchained() -> None:
    params = SamplingParams()
    params.n = 0  # mutable, as vLLM's: checked again when the request is parsed
    got: tuple[object, ...] = ("returned",)
    try:
        parse_params(params, "")
    except InvalidRequestError as exc:
        got = (type(exc).__name__, exc.field, exc.where, str(exc), exc.__context__)
    assert got == ("InvalidRequestError", "n", "", "n must be >= 1, got 0", None)


# --------------------------------------------------------------------------------------------
# A transformers fast tokenizer (no space clean-up) streams through DecodeStream, as vLLM's
# FastIncrementalDetokenizer does (engine/detokenizer.py: ``stream_backend``): kills
# request_builder.xǁRequestBuilderǁ__init____mutmut_5 (``_text_backend = None``), _6
# (``stream_backend(None)``: None) and xǁRequestBuilderǁbuild__mutmut_83
# (``make_detokenizer(None, ...)``), each of which streams through the Python rule instead.
# The two rules agree for every decoder whose text for earlier tokens never changes
# (tests/test_detok_stream.py); they part where a decoder rewrites earlier text into more
# characters but no more UTF-8 bytes: DecodeStream compares the texts' lengths in bytes (its
# Rust ``String::len``), the Python rule in characters.
# --------------------------------------------------------------------------------------------


def _rewriting_fast_tokenizer() -> Any:
    """Tokens "é" (0), "x" (1), "a" (2), fused, then "éé" decoded as "ab"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"é": 0, "x": 1, "a": 2}, unk_token="x"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("éé", "ab")])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, clean_up_tokenization_spaces=False
    )


def test_a_fast_tokenizers_completion_streams_as_decode_stream_does() -> None:
    tok = _rewriting_fast_tokenizer()
    assert (tok.decode([0]), tok.decode([0, 0]), tok.decode([0, 0, 1])) == ("é", "ab", "abx")
    builder = RequestBuilder(CONFIG, 16, 3, tok)
    request = builder.build("r", [1], {"max_tokens": 4}, "add_request", stream=True)
    detok = request.completions[0].detokenizer
    assert detok is not None
    texts = []
    for t in (0, 0, 1):
        detok.add(tok, [t])
        texts.append(detok.text)
    detok.flush(tok)
    texts.append(detok.text)
    # "é"; then "ab" (2 bytes) is not longer than "é" (2 bytes): DecodeStream holds the
    # token back (the Python rule, counting 2 characters against 1, would show "éab");
    # then "abx" does not start with "é": the stream refuses, the Python rule takes over
    # from the same window and emits from the common prefix (""): "abx".
    assert texts == ["é", "é", "éabx", "éabx"]
