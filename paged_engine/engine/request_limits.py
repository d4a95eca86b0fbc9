"""What one request may ask for, and the checks of its fields against it.

The bounds keep every request's cost within what a step can afford for it and for the
others batched with it: each says why it exists. ``inputs.check_request`` applies them at
admission, with the checks that need the engine (the model's vocabulary and length, the KV
pool); every refusal is an ``InvalidRequestError`` naming the field as the user spelled it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import Any, Protocol

from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
"""The most ``logprobs`` / ``prompt_logprobs`` a request may ask for by default
(``EngineConfig.max_logprobs``, vLLM's default)."""
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
"""Stop strings per request, and characters per stop string. Each step searches the new
text for every stop string, and a stream holds back the longest one's length less one
character (it may still be completed), so both bound a request's per-token cost and its
streaming delay. OpenAI takes 4 stop strings; 64 of up to 1,024 characters leave room for
any list a client builds by hand."""
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
"""``bad_words`` per request, and characters per word. Every word is tokenized at
admission, twice, on the engine's thread, and each step compares the generated tokens'
tail with each tokenized word in Python: both costs grow with the count and the length,
and a phrase of 256 characters is already far longer than a word."""
MAX_LOGIT_BIAS = 1024
"""Entries of ``logit_bias`` per request. Every step turns each entry into tensor elements
on the host, for every step of the request, so a whole-vocabulary bias would cost every
request in the batch that much per token. To restrict sampling to a large set of tokens,
``allowed_token_ids`` takes any number (up to the vocabulary)."""

Refuse = Callable[[str, str], InvalidRequestError]
"""``refuse(field, reason)``: the refusal to raise, naming which request of a batch."""


class Encoder(Protocol):
    """What ``bad_words`` are tokenized with (the engine's tokenizer)."""

    def encode(self, text: Any) -> Any: ...


def check_strings(
    values: tuple[str, ...], field: str, most: int, chars: int, refuse: Refuse
) -> None:
    """At most ``most`` strings in ``values``, each of at most ``chars`` characters."""
    if len(values) > most:
        raise refuse(field, f"{field} has {len(values)} strings, more than the {most} allowed")
    for s in values:
        if len(s) > chars:
            raise refuse(
                field,
                f"{field} holds a string of {len(s)} characters, more than the {chars} "
                f"allowed: {s[:40]!r}...",
            )


def logprobs_bound(max_logprobs: int, vocab_size: int | None) -> tuple[int, str]:
    """The most ``logprobs`` / ``prompt_logprobs`` a request may ask for, and what sets it:
    ``max_logprobs`` (-1: no bound of its own), never more than the vocabulary (a top-k
    beyond it does not exist, and would fail inside a step)."""
    limit = max_logprobs if max_logprobs >= 0 else None
    if vocab_size is not None and (limit is None or vocab_size < limit):
        return vocab_size, "the vocabulary size"
    if limit is None:
        return 2**63 - 1, "max_logprobs=-1"
    return limit, "max_logprobs"


def in_vocab(field: str, ids: SequenceABC[int], vocab_size: int, refuse: Refuse) -> None:
    """Every id of ``ids`` (checked >= 0 by ``SamplingParams``) below ``vocab_size``."""
    if ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise refuse(field, f"{field} names token {bad}, outside the vocabulary [0, {vocab_size})")


def with_bad_words(
    params: SamplingParams, tokenizer: Encoder | None, vocab_size: int | None, refuse: Refuse
) -> SamplingParams:
    """``params`` with ``bad_words_token_ids`` made from its ``bad_words`` (None without
    any): recomputed at every admission, so a request re-added (or built with ids of its
    own) is banned exactly what its words are under this model's tokenizer."""
    if not params.bad_words:
        if params.bad_words_token_ids is None:
            return params
        return replace(params, bad_words_token_ids=None)
    check_strings(params.bad_words, "bad_words", MAX_BAD_WORDS, MAX_BAD_WORD_CHARS, refuse)
    if tokenizer is None:
        raise refuse("bad_words", "bad_words need a tokenizer: they are banned as tokens")
    words = tokenize_bad_words(params.bad_words, tokenizer)
    if vocab_size is not None:
        in_vocab("bad_words", [t for w in words for t in w], vocab_size, refuse)
    return replace(params, bad_words_token_ids=words)


def tokenize_bad_words(words: SequenceABC[str], tokenizer: Encoder) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word, its leading spaces stripped, as it
    is (at the start of a text) and after one space (inside a text, for tokenizers whose
    tokens carry the space before a word), without special tokens; duplicates dropped."""
    encode = _plain_encoder(tokenizer)
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        base = word.lstrip()
        for text in (base, " " + base):
            ids = tuple(int(t) for t in encode(text))
            if ids:
                found[ids] = None
    return tuple(found)


def _plain_encoder(tokenizer: Encoder) -> Callable[[str], Any]:
    """``tokenizer.encode`` without special tokens where it takes ``add_special_tokens``
    (transformers' tokenizers may add a BOS, which is no part of a word)."""
    try:
        takes_flag = "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):  # no signature to read (a C callable)
        takes_flag = False
    if takes_flag:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
    return tokenizer.encode
