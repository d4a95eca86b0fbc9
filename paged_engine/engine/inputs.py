"""Prompts in, token ids out: every request is parsed and checked in full here, before the
engine changes any state, so a refused request leaves everything as it was.

Admission runs three steps, in this order (``RequestBuilder.build``): ``parse_prompt`` (a
text, token ids or a prompt dict, as checked token ids), ``parse_params`` (the sampling
params, built and so validated field by field: ``sampling_checks.py``), and
``check_request``, the one boundary that knows the model: the prompt and every token id a
request names (``logit_bias``, ``allowed_token_ids``, ``stop_token_ids``, the tokenized
``bad_words``) must lie in its vocabulary, and the request must fit ``max_model_len``, the
KV pool and the engine's bounds (``request_limits.py``), so nothing that could fail inside
a step for one request (and, in a batched step, for the others) is queued. Every refusal
is an ``InvalidRequestError`` naming the field as the user spelled it.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Protocol, TypedDict

from paged_engine.config import EngineConfig
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.request_limits import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    check_strings,
    in_vocab,
    logprobs_bound,
    with_bad_words,
)
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from paged_engine.sampling_params import SamplingParams


class _TextPromptKeys(TypedDict):
    prompt: str


class TextPrompt(_TextPromptKeys, total=False):
    """vLLM's text prompt: ``{"prompt": "..."}``, optionally with ``"cache_salt"`` (a
    string that isolates the request's prefix-cache entries from other salts'). A plain
    dict at run time: ``generate``, ``add_request`` and ``chat``'s prompts take either."""

    cache_salt: str


class _TokensPromptKeys(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptKeys, total=False):
    """vLLM's token prompt: ``{"prompt_token_ids": [...]}``, optionally with
    ``"cache_salt"`` and the ``"prompt"`` text the ids came from (reported back as the
    output's ``prompt``; the ids are what runs)."""

    prompt: str
    cache_salt: str


_PROMPT_KEYS = frozenset(TextPrompt.__annotations__) | frozenset(TokensPrompt.__annotations__)
"""Every key a prompt dict may hold: the two TypedDicts' (anything else is refused)."""


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer: text prompts and ``bad_words`` in, text out."""

    def encode(self, text: Any) -> Any: ...
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    token_ids: list[int]
    text: str | None
    cache_salt: str | None


def is_single_prompt(prompts: object) -> bool:
    """A string, a prompt dict, or a non-empty list of token ids (not a list of prompts)."""
    if isinstance(prompts, str | Mapping):
        return True
    return (
        isinstance(prompts, list | tuple)
        and bool(prompts)
        and all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompts)
    )


def parse_prompt(
    prompt: object, tokenizer: Tokenizer | None, vocab_size: int, where: str
) -> ParsedPrompt:
    """A text, a list of token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``
    (either with an optional ``"cache_salt"``), as checked token ids."""
    text: str | None = None
    salt: object = None
    field = "prompt"
    if isinstance(prompt, Mapping):
        unknown = sorted(set(map(str, prompt)) - _PROMPT_KEYS)
        if unknown:
            raise InvalidRequestTypeError(
                "prompt",
                f"unknown prompt key(s) {unknown}; known: {sorted(_PROMPT_KEYS)}",
                where,
            )
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequestTypeError(
                "cache_salt", f"cache_salt must be a string, got {salt!r}", where
            )
        if salt == "":  # as Sequence refuses it (see there)
            raise InvalidRequestError("cache_salt", "cache_salt must be a non-empty string", where)
        if "prompt_token_ids" in prompt:
            raw: object = prompt["prompt_token_ids"]
            field = "prompt_token_ids"
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestTypeError(
                    "prompt", f"prompt must be a string, got {text!r}", where
                )
            if not isinstance(raw, list | tuple):
                raise InvalidRequestTypeError(
                    field, f"prompt_token_ids must be a list of ints, got {raw!r}", where
                )
        elif "prompt" in prompt:
            raw = text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidRequestTypeError(
                    "prompt", f"prompt must be a string, got {text!r}", where
                )
        else:
            raise InvalidRequestTypeError(
                "prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'", where
            )
    else:
        raw = prompt
    if isinstance(raw, str):
        if tokenizer is None:
            raise InvalidRequestTypeError(
                "prompt", "a text prompt needs a tokenizer; pass token ids", where
            )
        text = raw
        tokens = list(tokenizer.encode(raw))
    elif isinstance(raw, list | tuple):
        tokens = list(raw)
    else:
        raise InvalidRequestTypeError(
            "prompt",
            f"a prompt is a string, a list of token ids or a prompt dict, got {type(raw).__name__}",
            where,
        )
    checked = _check_tokens(tokens, vocab_size, field, where)
    return ParsedPrompt(checked, text, salt)  # type: ignore[arg-type]


def _check_tokens(tokens: list[Any], vocab_size: int, field: str, where: str) -> list[int]:
    if not tokens:
        raise InvalidRequestError(field, "the prompt is empty", where)
    # The common case, checked at C speed; otherwise find and name the offending token.
    if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return tokens
    ids: list[int] = []
    for i, t in enumerate(tokens):
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise InvalidRequestTypeError(field, f"token {i} is {t!r}, not an int", where)
        if not 0 <= int(t) < vocab_size:
            raise InvalidRequestError(
                field, f"token {i} is {t}, outside the vocabulary [0, {vocab_size})", where
            )
        ids.append(int(t))
    return ids


def parse_params(params: object, where: str) -> SamplingParams:
    """The request's own ``SamplingParams``: a new record, never the caller's object.

    Why a copy: ``SamplingParams`` is mutable (as vLLM's), so a field may have been set
    to a bad value after construction, and the caller may change the object again once
    the request runs. Building a copy validates every field again (the refusal names the
    field and ``where``), and the copy is the engine's alone."""
    try:
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params.clone()
        if isinstance(params, dict):
            return SamplingParams.from_dict(params)
    except InvalidRequestError as e:
        if where and not e.where:
            raise type(e)(e.field, e.reason, where) from None
        raise
    raise InvalidRequestTypeError(
        "sampling_params",
        f"sampling params must be SamplingParams or a dict, got {params!r}",
        where,
    )


def check_request(
    tokens: SequenceABC[int],
    params: SamplingParams,
    config: EngineConfig,
    pool_blocks: int,
    where: str,
    *,
    has_tokenizer: bool,
    vocab_size: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """Refuse a request the engine cannot run in full, and return the params to queue it
    with: ``params`` itself, or a copy whose ``bad_words_token_ids`` are its
    ``bad_words`` tokenized by ``tokenizer`` (which those need).

    What it needs of the engine: room in ``max_model_len`` and the pool for one completion
    at full length (completions share the pool in turn, by preemption), ``n`` within
    ``config.max_n``, and the bounds of ``request_limits.py``. ``vocab_size`` (the model's;
    None skips those checks) bounds every token id the request names.
    """

    def refuse(field: str, reason: str) -> InvalidRequestError:
        return InvalidRequestError(field, reason, where)

    if params.n > config.max_n:
        raise refuse("n", f"n={params.n} is more than the {config.max_n} allowed (max_n)")
    n = len(tokens)
    limit = config.max_model_len
    if n >= limit:
        raise refuse(
            "prompt",
            f"the prompt ({n} tokens) leaves no room for a token within max_model_len ({limit})",
        )
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise refuse(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds max_model_len ({limit})",
        )
    total = limit if params.max_tokens is None else n + params.max_tokens
    # The last sampled token is never computed, so it needs no slot.
    need = num_blocks(total - 1, config.kvcache_block_size)
    if need > pool_blocks:
        raise refuse(
            "max_tokens",
            f"the request needs {need} KV blocks at full length but the pool has {pool_blocks}",
        )
    most, bound = logprobs_bound(config.max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > most:
            raise refuse(name, f"{name}={k} is more than the {most} allowed ({bound})")
    check_strings(params.stop, "stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, refuse)
    if params.stop and not has_tokenizer:
        raise refuse("stop", "stop strings need a tokenizer (use stop_token_ids)")
    if params.stop and not params.detokenize:
        raise refuse("stop", "stop strings need detokenize=True")
    bias = params.logit_bias or ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise refuse(
            "logit_bias",
            f"logit_bias has {len(bias)} entries, more than the {MAX_LOGIT_BIAS} allowed "
            "(allowed_token_ids takes any number)",
        )
    if vocab_size is not None:
        in_vocab("logit_bias", [t for t, _ in bias], vocab_size, refuse)
        in_vocab("allowed_token_ids", params.allowed_token_ids or (), vocab_size, refuse)
        in_vocab("stop_token_ids", params.stop_token_ids, vocab_size, refuse)
    return with_bad_words(params, tokenizer, vocab_size, refuse)
