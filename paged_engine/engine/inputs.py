"""Prompts in, token ids out: every request is parsed and checked in full here, before the
engine changes any state, so a refused request leaves everything as it was."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Protocol

from paged_engine.config import EngineConfig
from paged_engine.engine.indexing import num_blocks
from paged_engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
"""The most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default)."""

_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class Tokenizer(Protocol):
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
    if isinstance(prompt, Mapping):
        unknown = sorted(set(map(str, prompt)) - _PROMPT_KEYS)
        if unknown:
            raise TypeError(
                f"{where}: unknown prompt key(s) {unknown}; known: {sorted(_PROMPT_KEYS)}"
            )
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"{where}: cache_salt must be a string, got {salt!r}")
        if salt == "":  # as Sequence refuses it (see there)
            raise ValueError(f"{where}: cache_salt must be a non-empty string")
        if "prompt_token_ids" in prompt:
            raw: object = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{where}: prompt must be a string, got {text!r}")
            if not isinstance(raw, list | tuple):
                raise TypeError(f"{where}: prompt_token_ids must be a list of ints, got {raw!r}")
        elif "prompt" in prompt:
            raw = text = prompt["prompt"]
            if not isinstance(text, str):
                raise TypeError(f"{where}: prompt must be a string, got {text!r}")
        else:
            raise TypeError(f"{where}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    else:
        raw = prompt
    if isinstance(raw, str):
        if tokenizer is None:
            raise TypeError(f"{where}: a text prompt needs a tokenizer; pass token ids")
        text = raw
        tokens = list(tokenizer.encode(raw))
    elif isinstance(raw, list | tuple):
        tokens = list(raw)
    else:
        raise TypeError(
            f"{where}: a prompt is a string, a list of token ids or a prompt dict, "
            f"got {type(raw).__name__}"
        )
    return ParsedPrompt(_check_tokens(tokens, vocab_size, where), text, salt)  # type: ignore[arg-type]


def _check_tokens(tokens: list[Any], vocab_size: int, where: str) -> list[int]:
    if not tokens:
        raise ValueError(f"{where}: the prompt is empty")
    # The common case, checked at C speed; otherwise find and name the offending token.
    if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return tokens
    ids: list[int] = []
    for i, t in enumerate(tokens):
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise TypeError(f"{where}: token {i} is {t!r}, not an int")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{where}: token {i} is {t}, outside the vocabulary [0, {vocab_size})")
        ids.append(int(t))
    return ids


def parse_params(params: object, where: str) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise TypeError(f"{where}: sampling params must be SamplingParams or a dict, got {params!r}")


def check_request(
    tokens: SequenceABC[int],
    params: SamplingParams,
    config: EngineConfig,
    pool_blocks: int,
    where: str,
    *,
    has_tokenizer: bool,
    vocab_size: int | None = None,
) -> None:
    """What a request needs of the engine: room in ``max_model_len`` and the pool for one
    completion at full length (completions share the pool in turn, by preemption)."""
    n = len(tokens)
    limit = config.max_model_len
    if n >= limit:
        raise ValueError(
            f"{where}: the prompt ({n} tokens) leaves no room for a token within "
            f"max_model_len ({limit})"
        )
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise ValueError(
            f"{where}: prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds max_model_len ({limit})"
        )
    total = limit if params.max_tokens is None else n + params.max_tokens
    # The last sampled token is never computed, so it needs no slot.
    need = num_blocks(total - 1, config.kvcache_block_size)
    if need > pool_blocks:
        raise ValueError(
            f"{where}: the request needs {need} KV blocks at full length but the pool "
            f"has {pool_blocks}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > MAX_LOGPROBS:
            raise ValueError(f"{where}: {name}={k} is more than the {MAX_LOGPROBS} allowed")
    if params.stop and not has_tokenizer:
        raise ValueError(f"{where}: stop strings need a tokenizer (use stop_token_ids)")
    if params.stop and not params.detokenize:
        raise ValueError(f"{where}: stop strings need detokenize=True")
