"""The server's size limits, checked before any costly work: the request body (before it
is parsed) and each prompt's characters (before it is tokenized).

Why: tokenizing is linear in the text and runs before the engine can say the prompt is
too long, and parsing is linear in the body; without a bound, one client could make the
server tokenize or parse megabytes per request. Each refusal names what was too large and
the flag that sets the limit, and happens before anything is queued.

The prompt limit comes from the model: ``max_model_len`` times the longest entry of the
tokenizer's vocabulary, in characters. Every token stands for at most that many
characters, so a longer prompt cannot tokenize to ``max_model_len`` tokens or fewer and
would be refused anyway, after tokenizing (a normalizer that composes characters, such as
NFC, can shorten a text a little first: the limit leaves no margin for it).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from paged_engine.entrypoints.serving import RequestError

FALLBACK_CHARS_PER_TOKEN = 64
"""Characters per token assumed for a tokenizer without a readable vocabulary."""


def longest_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in characters (byte-level BPE spells each byte as one
    character, so this bounds the decoded text of any token), or None if unknown."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # a tokenizer that cannot list its vocabulary: use the fallback
        return None
    return max(map(len, vocab), default=None) if vocab else None


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int:
    """The default ``max_prompt_chars`` for this model (see the module docstring)."""
    per_token = longest_token_chars(tokenizer) or FALLBACK_CHARS_PER_TOKEN
    return max_model_len * per_token


def body_too_large(size: int, limit: int) -> RequestError:
    return RequestError(
        f"the request body is {size:,} bytes or more, more than the {limit:,} this server "
        "takes (--max-request-body-bytes)",
        status=413,
        code="request_too_large",
    )


def prompt_too_long(what: str, chars: int, limit: int, param: str) -> RequestError:
    return RequestError(
        f"{what} is {chars:,} characters, more than the {limit:,} this server takes "
        "(--max-prompt-chars: max_model_len times the longest token); it could not fit",
        param=param,
        code="prompt_too_long",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes (from
    its Content-Length before reading anything, else while it arrives)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_prompt_chars(prompts: list[Any], limit: int) -> None:
    """400 naming ``prompt`` for the first text prompt longer than ``limit`` characters."""
    for i, p in enumerate(prompts):
        if isinstance(p, str) and len(p) > limit:
            what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise prompt_too_long(what, len(p), limit, "prompt")


def text_chars(value: object) -> int:
    """The characters of every string in a JSON-like value (a chat's messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


def admit(
    prompts: int,
    n: int,
    max_queue: int,
    queued: int,
    rename: dict[str, str],
    unavailable: str | None,
) -> int:
    """The sequences (``prompts * n``) a request would hold, if it may be queued now: a
    400 naming the field when it alone needs more than ``max_queue`` (it can never fit),
    a 503 when it could fit later (``queued`` leaves no room, or ``unavailable`` says why
    the server takes nothing now)."""
    sequences = prompts * n
    if sequences > max_queue:
        raise RequestError(
            f"this request needs {sequences} sequences ({prompts} prompt(s) times n={n}), more "
            f"than the {max_queue} this server can ever hold (--max-queue)",
            param=rename.get("prompt", "prompt") if prompts > max_queue else "n",
            code="invalid_value",
        )
    if unavailable is not None:
        raise RequestError(unavailable, status=503)
    if queued + sequences > max_queue:
        raise RequestError(
            f"the server is full: it holds {queued} of at most {max_queue} sequences "
            "(--max-queue); retry later",
            status=503,
            code="overloaded",
        )
    return sequences
